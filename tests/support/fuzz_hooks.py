"""Schemathesis hooks for tests/http/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

positive_data_acceptance, with the one kind of refusal a JSON schema cannot state: a rule across
fields or across the model (each listed in docs/API.md "Rules across fields"). Every other refusal of a
body the document calls valid stays a failure."""
from __future__ import annotations

import re

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# The server's messages for those rules (handler/engine/admission.py, handler/http/protocols/*.py)
CROSS_FIELD = re.compile("|".join([
    r"exceeds this model's \d+ tokens",               # prompt tokens + max tokens > max_model_len
    r"the chat template refused these messages",      # the model's own template decides the roles it takes
    r"names no tool_use block",                       # a tool_result must answer an earlier tool_use
    r"names no earlier function_call",                # a function_call_output must answer an earlier call
    r"needs `tools`|must name one of the tools",      # a tool choice needs the tools it names
    r"needs a tool-call format",                      # tools called freely need the model's call format
    r"holds no message to answer",                    # a Responses input needs a message among its items
    r"conflicts with",                                # one output constraint per request
    # a constraint's own language: the guided-decoding compiler takes the schema, regex or grammar or names
    # what it refuses (handler/engine/guide.py)
    r"is not a valid regular expression|cannot be compiled for guided decoding|is not supported by guided "
    r"decoding|is not valid JSON|is not a valid JSON schema|nested more than 64 levels",
]))


@schemathesis.check
def accepted_unless_a_cross_field_rule(ctx, response, case):
    if response.status_code in (400, 422) and CROSS_FIELD.search(response.text or ""):
        return None
    return positive_data_acceptance(ctx, response, case)
