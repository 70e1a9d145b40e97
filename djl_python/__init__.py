"""The part of LMI's `djl_python` package that a model directory's `model.py` uses (LMI's custom handler
and formatter contract: handler/http/custom.py loads the file and calls it). Written from djl-serving's
documentation and the API its examples call (engines/python/setup/djl_python/inputs.py, outputs.py,
input_parser.py, output_formatter.py, encode_decode.py); LMI's own modules are not vendored here.
"""
from djl_python.inputs import Input
from djl_python.outputs import Output

__all__ = ["Input", "Output"]
