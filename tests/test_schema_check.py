"""check_json_schema: what a grammar library would drop or take unchecked is refused, naming the field."""

import pytest

from tinyserve.errors import InvalidInputError
from tinyserve.sampling_params import StructuredOutputsParams
from tinyserve.structured_output.schema_check import (
    MAX_CHOICES,
    MAX_DEPTH,
    MAX_GRAMMAR_CHARS,
    MAX_PROPERTIES,
    MAX_REGEX_CHARS,
    check_json_schema,
)

USABLE = [
    True, {}, {"type": "object", "properties": {"a": {"type": ["string", "null"]}}, "required": ["a"]},
    {"$defs": {"n": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/n"}},
    {"anyOf": [{"type": "string"}, {"enum": [1, 2]}], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "number"}], "items": False},
    {"type": "object", "x-unknown-keyword": {"anything": 5}},  # left to the grammar library
]
UNUSABLE = [
    ({"type": 5}, "type must be one of"),
    ({"type": "text"}, "type must be one of"),
    ({"type": []}, "type must be one of"),
    ([], "must be an object or a boolean"),
    ({"properties": {"a": "string"}}, "must be an object or a boolean, got str at /properties/a"),
    ({"properties": []}, "properties must be an object of schemas"),
    ({"required": "a"}, "required must be a list"),
    ({"anyOf": []}, "anyOf must be a non-empty list"),
    ({"items": {"$ref": "https://example.com/s.json"}}, "points outside the schema"),
    ({"$ref": "other.json#/x"}, "points outside the schema"),
    ({"enum": "abc"}, "enum must be a list"),
]


@pytest.mark.parametrize("schema", USABLE)
def test_usable_schemas_pass(schema):
    check_json_schema(schema, "structured_outputs")


@pytest.mark.parametrize("schema, words", UNUSABLE)
def test_unusable_schemas_are_refused_naming_the_field_and_the_place(schema, words):
    with pytest.raises(InvalidInputError, match=words) as refused:
        check_json_schema(schema, "tools")
    assert refused.value.param == "tools"


def test_nesting_is_bounded_and_the_engine_checks_too():
    deep = {}
    for _ in range(MAX_DEPTH + 2):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidInputError, match="nests more than"):
        check_json_schema(deep, "response_format")
    with pytest.raises(InvalidInputError, match="points outside") as refused:  # offline, as over HTTP
        StructuredOutputsParams(json='{"$ref": "http://127.0.0.1:9/x.json"}')
    assert refused.value.param == "structured_outputs"


def test_constraints_past_their_size_limits_are_refused_naming_the_field_and_the_limit():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(MAX_PROPERTIES + 1)}}
    with pytest.raises(InvalidInputError, match=f"{MAX_PROPERTIES + 1} properties; at most {MAX_PROPERTIES}"):
        check_json_schema(wide, "response_format")
    nested = {"$defs": {"a": {"properties": {f"q{i}": {} for i in range(MAX_PROPERTIES)}}},
              "properties": {"x": {"$ref": "#/$defs/a"}}}  # definitions count too
    with pytest.raises(InvalidInputError, match="properties; at most"):
        check_json_schema(nested, "tools")
    for fields, words in (({"regex": "a" * (MAX_REGEX_CHARS + 1)}, "structured_outputs.regex has"),
                          ({"grammar": "root ::= " + '"a" ' * MAX_GRAMMAR_CHARS}, "structured_outputs.grammar has"),
                          ({"choice": ["x"] * (MAX_CHOICES + 1)}, "choices; at most")):
        with pytest.raises(InvalidInputError, match=words) as refused:
            StructuredOutputsParams(**fields)
        assert refused.value.param == "structured_outputs"
    StructuredOutputsParams(regex="a" * MAX_REGEX_CHARS)  # at the limit: fine
