"""The decode step's layers in C++ (``decode_layer.cpp``), built at first use against the
installed torch (``build``) and checked to give the Python step's bits before use
(``layers``)."""
