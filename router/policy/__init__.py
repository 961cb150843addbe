"""Selection policies: pure decision logic (no I/O, no clock reads), owned by the Scorer actor."""
