/* A packed ``repeated int64`` field, encoded as protobuf encodes it, from a tuple or list of ints.

Optional: built when a C compiler is at hand (setup.py marks the extension optional), and
``router.wire.decode`` encodes with protobuf when it is not. For 512 block keys protobuf spends most
of its time turning each 64-bit int into a machine integer through CPython's general byte-array path
and writing its varint; this converts each int with CPython's digit loop
(``PyLong_AsLongLongAndOverflow``) and writes the same bytes.

Anything but exact ints in a tuple or list, or an int outside the signed 64-bit range, returns None:
the caller encodes those with protobuf, whose answer (its error included) is then the only one.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_VARINT 10 /* bytes of a 64-bit varint */
#define HEAD_ROOM (2 * MAX_VARINT) /* the field's tag and its length, written ahead of the values */

static unsigned char *
put_varint(unsigned char *p, unsigned long long value)
{
    while (value >= 0x80) {
        *p++ = (unsigned char)(value | 0x80);
        value >>= 7;
    }
    *p++ = (unsigned char)value;
    return p;
}

static PyObject *
packed_int64(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "packed_int64(field_number, values) takes 2 arguments");
        return NULL;
    }
    long field = PyLong_AsLong(args[0]);
    if (field == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (field < 1 || field > 536870911) {
        PyErr_SetString(PyExc_ValueError, "field_number: not a protobuf field number (1..2**29-1)");
        return NULL;
    }
    PyObject *values = args[1];
    if (!PyTuple_CheckExact(values) && !PyList_CheckExact(values)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(values);
    if (n == 0) { /* an empty packed field is not written at all */
        return PyBytes_FromStringAndSize(NULL, 0);
    }
    if (n > (PY_SSIZE_T_MAX - HEAD_ROOM) / MAX_VARINT) {
        Py_RETURN_NONE;
    }
    unsigned char *buffer = PyMem_Malloc((size_t)n * MAX_VARINT + HEAD_ROOM);
    if (buffer == NULL) {
        return PyErr_NoMemory();
    }
    /* No Python code runs in this loop (an exact int has no __index__ to call), so a list cannot
       change under it. */
    PyObject **items = PySequence_Fast_ITEMS(values);
    unsigned char *end = buffer + HEAD_ROOM;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            PyMem_Free(buffer);
            Py_RETURN_NONE;
        }
        int overflow = 0;
        long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow) {
            PyMem_Free(buffer);
            Py_RETURN_NONE;
        }
        if (value == -1 && PyErr_Occurred()) {
            PyMem_Free(buffer);
            return NULL;
        }
        end = put_varint(end, (unsigned long long)value); /* a negative int64 is its two's complement */
    }
    unsigned char head[HEAD_ROOM];
    unsigned char *head_end = put_varint(head, ((unsigned long long)field << 3) | 2); /* length-delimited */
    head_end = put_varint(head_end, (unsigned long long)(end - (buffer + HEAD_ROOM)));
    size_t head_size = (size_t)(head_end - head);
    unsigned char *start = buffer + HEAD_ROOM - head_size;
    memcpy(start, head, head_size);
    PyObject *encoded = PyBytes_FromStringAndSize((const char *)start, (Py_ssize_t)(end - start));
    PyMem_Free(buffer);
    return encoded;
}

static PyMethodDef methods[] = {
    {"packed_int64", (PyCFunction)(void (*)(void))packed_int64, METH_FASTCALL,
     "packed_int64(field_number, values) -> bytes | None: the packed repeated int64 field, as protobuf "
     "encodes it; None for values it does not take (see the module)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "router.wire._packed",
    "A packed repeated int64 field's encoding (optional; protobuf encodes it otherwise).",
    0,
    methods,
};

PyMODINIT_FUNC
PyInit__packed(void)
{
    return PyModule_Create(&module);
}
