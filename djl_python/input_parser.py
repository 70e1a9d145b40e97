"""`@input_formatter`: marks the model.py function that rewrites each decoded request body before the
built-in handler reads it (`fn(decoded_payload: dict, tokenizer=None, **kwargs) -> dict`)."""


def input_formatter(fn):
    fn.is_input_formatter = True
    return fn
