"""Simulators, the demo and the bench around the kvroute router: tools, not the product.

Shipped in the kvroute distribution, but its third-party needs are the ``demo`` extra's
(``pip install 'kvroute[demo]'``), and the product (``router``, ``actors``) never imports it.
"""
