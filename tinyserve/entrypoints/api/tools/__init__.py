"""Tool calls and the structured-output protocol shared by every API: schemas into grammars,
model text into tool calls."""
