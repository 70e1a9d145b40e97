from djl_python import Input, Output
from djl_python.encode_decode import decode

_properties = None


def handle(inputs: Input):
    """
    Default handler function
    """
    global _properties
    if _properties is None:
        # stateful model
        _properties = inputs.get_properties()

    if inputs.is_empty():
        # initialization request
        return None

    content_type = inputs.get_property("Content-Type")
    payload = decode(inputs, content_type)
    if "inputs" not in payload:
        return Output().error("the body needs inputs", code=400)
    text = payload["inputs"][0] if isinstance(payload["inputs"], list) else payload["inputs"]
    return Output().add_as_json({"echo": text.upper(), "model_id": _properties.get("model_id"),
                                 "as_string": inputs.get_as_string()[:9]})
