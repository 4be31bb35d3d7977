"""YAML read safely: PyYAML's safe loader with no aliases (a few hundred bytes of nested aliases
expand to gigabytes), no key given twice in a mapping (the last would silently win), at most
`MAX_YAML` bytes. Used for config files, overrides and run records."""

import yaml

MAX_YAML = 1 << 20  # bytes of a config file


class DuplicateKeyError(yaml.YAMLError):
    """A mapping that gives one key twice; the message names its dotted path and lines."""


def _check_unique(node: yaml.Node, path: str = "") -> None:
    """Refuse a key given twice in any mapping under `node` (keys compared as text, as
    `_normalize` reads them)."""
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique(item, f"{path}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
            continue
        key = str(key_node.value)
        dotted = f"{path}.{key[:40]}" if path else key[:40]
        line = key_node.start_mark.line + 1
        if key in seen:
            where = f"line {line}" if seen[key] == line else f"lines {seen[key]} and {line}"
            raise DuplicateKeyError(f"key '{dotted}' is given twice ({where}); keep one")
        seen[key] = line
        _check_unique(value_node, dotted)


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases (`*name`): nothing expands beyond the text; and
    without duplicate keys (`_check_unique`)."""

    def compose_document(self):
        node = super().compose_document()
        _check_unique(node)
        return node

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(
                f"alias *{str(event.anchor)[:40]} at line {event.start_mark.line + 1}: aliases "
                "are not supported, write the value out"
            )
        return super().compose_node(parent, index)


def safe_yaml(text: str) -> object:
    """Parse YAML `text` with the bounded loader (`yaml.YAMLError` for an alias, a duplicate
    key, a text over `MAX_YAML` bytes, or nesting too deep to parse)."""
    if len(text) > MAX_YAML:
        raise yaml.YAMLError(f"{len(text):,} bytes is more than {MAX_YAML:,}")
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
