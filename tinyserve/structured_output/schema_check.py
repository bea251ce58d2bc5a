"""A JSON schema checked before a grammar library sees it, or a tool is shown to a chat template.

The grammar libraries are lenient where a client should be told: xgrammar warns and drops a
remote `$ref` (the output is then unconstrained, with a 200), and a tool whose parameters are
not a schema at all (`{"type": 5}`) is taken as long as nothing compiles it (tool_choice
"none"). OpenAI answers both with a 400. `check_json_schema` walks the keywords that shape the
output (types, properties, items, combinators, references) and refuses, naming the field:

- a schema that is neither an object nor a boolean, anywhere in the tree;
- a `type` that is not one of JSON's seven types (or a list of them);
- keywords of the wrong kind (`properties` not an object of schemas, `required` not a list
  of strings, `anyOf` not a non-empty list of schemas, ...);
- a `$ref` that does not point inside the schema (`#...`): nothing is fetched from elsewhere;
- nesting deeper than MAX_DEPTH, or more than MAX_PROPERTIES properties in all (OpenAI's
  limit): compiling grows with them (6,000 properties take xgrammar about 25 s on two cores),
  and a compile holds one of the engine's two compile threads however long it takes.

The size of the other constraints is bounded in `check_constraint_size`.

It is not a full meta-schema validation: keywords it does not know are left to the library.
"""

from tinyserve.errors import InvalidInputError

JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
MAX_DEPTH = 64  # schemas nested deeper than this are refused (a recursion bound, far past real ones)
MAX_PROPERTIES = 5000  # properties in a whole schema, as OpenAI's structured outputs allow
# A regex or a grammar's text, and a choice's strings together, at most this many characters; at most
# MAX_CHOICES choices (OpenAI's limit on enum values). Past them, a 400 naming the field and the limit.
MAX_REGEX_CHARS = 16_384
MAX_GRAMMAR_CHARS = 65_536
MAX_CHOICES = 1000
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def check_json_schema(schema, param: str) -> None:
    """Raise InvalidInputError(param) naming the first problem of `schema` (see the module's list)."""
    problem = _problem(schema, "", 0)
    if problem is not None:
        raise InvalidInputError(f"not a usable JSON schema: {problem}", param)
    num_properties = _count_properties(schema)
    if num_properties > MAX_PROPERTIES:
        raise InvalidInputError(f"the schema has {num_properties} properties; at most {MAX_PROPERTIES} are compiled",
                                param)


def check_constraint_size(kind: str, value, param: str) -> None:
    """A regex, grammar or choice over its limit: InvalidInputError naming the field and the limit."""
    if kind == "choice":
        if len(value) > MAX_CHOICES:
            raise InvalidInputError(f"{param}.choice has {len(value)} choices; at most {MAX_CHOICES}", param)
        size, limit = sum(len(c) for c in value), MAX_GRAMMAR_CHARS
    else:
        size, limit = len(value), MAX_REGEX_CHARS if kind == "regex" else MAX_GRAMMAR_CHARS
    if size > limit:
        raise InvalidInputError(f"{param}.{kind} has {size} characters; at most {limit} are compiled", param)


def _count_properties(schema) -> int:
    """Every property of every object in the schema (definitions included); the schema passed _problem."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            count += len(node["properties"]) if isinstance(node.get("properties"), dict) else 0
            stack.extend(value for key, value in node.items() if key not in ("enum", "const", "default", "examples"))
    return count


def _problem(schema, path: str, depth: int) -> str | None:
    where = path or "the top level"
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"a schema must be an object or a boolean, got {type(schema).__name__} at {where}"
    if depth > MAX_DEPTH:
        return f"the schema nests more than {MAX_DEPTH} levels deep"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(isinstance(k, str) and k in JSON_TYPES for k in kinds) or kind == []:
        return f"type must be one of {', '.join(JSON_TYPES)} (or a list of them), got {kind!r} at {where}"
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        return (f"$ref {str(ref)[:200]!r} at {where} points outside the schema; only references within it "
                "(#/$defs/...) are followed, nothing is fetched")
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return f"required must be a list of property names at {where}"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"enum must be a list at {where}"
    return _children_problem(schema, path, depth)


def _children_problem(schema: dict, path: str, depth: int) -> str | None:
    where = path or "the top level"
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{key} must be an object of schemas at {where}"
            for name, child in schema[key].items():
                if (problem := _problem(child, f"{path}/{key}/{name}", depth + 1)) is not None:
                    return problem
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or (key != "prefixItems" and not schema[key]):
                return f"{key} must be a {'' if key == 'prefixItems' else 'non-empty '}list of schemas at {where}"
            for index, child in enumerate(schema[key]):
                if (problem := _problem(child, f"{path}/{key}/{index}", depth + 1)) is not None:
                    return problem
    items = schema.get("items")
    children = [("items", items)] if not isinstance(items, list) else [(f"items/{i}", s) for i, s in enumerate(items)]
    children += [(key, schema[key]) for key in _SCHEMAS if key in schema]
    for key, child in children:
        if child is not None and (problem := _problem(child, f"{path}/{key}", depth + 1)) is not None:
            return problem
    return None
