"""Rule files: an ordered YAML list that places each module of the tree on an operator and a device.

    - default: {device: cuda, models: [glm_moe_dsa]}   # optional, first entry only: where unmatched modules go,
                                                      # and the model families (config model_type) the file suits
    - match: {name: 'mlp\\.experts$', class: Experts}   # regex searched in the dotted name, and/or class
      replace: {op: experts.reference, device: cpu, kwargs: {}}
      recursive: false                     # the operator owns the whole subtree (default: true)

Modules are visited parent first; the first rule that matches a module places it. A placed module's
children not matched themselves inherit its device, with their default operator. A module that
neither a rule nor an ancestor's rule matched gets its default operator on the default device.
Rule files are data: read by yaml's safe loader (without aliases), and only registered operators can be named.
"""

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import yaml
from torch import nn

from . import model
from .config import MODEL_TYPES
from .errors import Glm5Error
from .ops import DEFAULT_OP, REGISTRY
from .ops.base import Operator, Slot
from .util import human_bytes, ranges

RULE_KEYS = {"match", "replace", "recursive"}
MATCH_KEYS = {"name", "class"}
# the shipped placement a user gets without --rules, per model family (rules/glm5.yaml, rules/glm5-flash.yaml)
DEFAULT_RULES = {"glm_moe_dsa": "glm5", "deepseek_v32": "glm5", "glm5_next": "glm5-flash"}
REPLACE_KEYS = {"op", "device", "kwargs"}
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class Rule:
    index: int  # 1-based position in the file, as error messages and reports name it
    name: re.Pattern | None
    cls: str | None
    op: Operator | None
    device: str | None
    kwargs: dict
    recursive: bool

    def matches(self, name: str, module: nn.Module) -> bool:
        return (self.name is None or self.name.search(name) is not None) and (
            self.cls is None or type(module).__name__ == self.cls)

    def describe(self) -> str:
        parts = [f"name~{self.name.pattern}" if self.name else "", f"class={self.cls}" if self.cls else ""]
        return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class RuleFile:
    path: str
    default_device: str | None
    rules: tuple[Rule, ...]
    models: tuple[str, ...] | None = None  # the model families it suits (None: any)


def module_classes() -> set[str]:
    """Class names a rule can match: every class in the module tree."""
    names = {c.__name__ for c in vars(model).values() if isinstance(c, type) and issubclass(c, nn.Module)}
    return names | {"Embedding", "ModuleList"}


def _check_keys(where: str, entry, allowed: set, what: str):
    if not isinstance(entry, dict):
        raise Glm5Error(f"{where}: {what} must be a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise Glm5Error(f"{where}: unknown key '{unknown[0]}' in {what} (allowed: {', '.join(sorted(allowed))})")


def check_device(where: str, device) -> str:
    if not isinstance(device, str) or not _DEVICE.match(device):
        raise Glm5Error(f"{where}: device must be cpu, cuda or cuda:N, got {device!r}")
    return device


def _parse_rule(where: str, index: int, entry) -> Rule:
    _check_keys(where, entry, RULE_KEYS, "a rule")
    if "match" not in entry or "replace" not in entry:
        raise Glm5Error(f"{where}: a rule needs 'match' and 'replace'")
    match, replace = entry["match"], entry["replace"]
    _check_keys(where, match, MATCH_KEYS, "match")
    _check_keys(where, replace, REPLACE_KEYS, "replace")
    if not match:
        raise Glm5Error(f"{where}: match needs 'name' (a regex) and/or 'class'")
    pattern = None
    if "name" in match:
        if not isinstance(match["name"], str):
            raise Glm5Error(f"{where}: match.name must be a regex string, got {match['name']!r}")
        try:
            pattern = re.compile(match["name"])
        except re.error as e:
            raise Glm5Error(f"{where}: invalid regex {match['name']!r} in match.name ({e})") from None
    cls = match.get("class")
    if cls is not None and cls not in module_classes():
        raise Glm5Error(f"{where}: unknown class {cls!r} in match.class (known: {', '.join(sorted(module_classes()))})")
    if not replace or not ({"op", "device"} & set(replace)):
        raise Glm5Error(f"{where}: replace needs 'op' and/or 'device'")
    op = None
    if "op" in replace:
        op = REGISTRY.get(replace["op"]) if isinstance(replace["op"], str) else None
        if op is None:
            raise Glm5Error(f"{where}: unknown operator {replace['op']!r} (registered: {', '.join(sorted(REGISTRY))})")
        if cls is not None and cls != op.replaces.__name__:
            raise Glm5Error(f"{where}: operator {op.name} replaces {op.replaces.__name__}, not {cls}")
    device = check_device(where, replace["device"]) if "device" in replace else None
    kwargs = replace.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise Glm5Error(f"{where}: kwargs must be a mapping, got {kwargs!r}")
    if kwargs and op is None:
        raise Glm5Error(f"{where}: kwargs need an 'op' to go to")
    for key in kwargs:
        if key not in op.kwargs:
            takes = f"it takes: {', '.join(op.kwargs)}" if op.kwargs else "it takes none"
            raise Glm5Error(f"{where}: operator {op.name} takes no kwarg {key!r} ({takes})")
    if op is not None:
        try:
            kwargs = op.parse_kwargs(kwargs)
        except Glm5Error as e:
            raise Glm5Error(f"{where}: operator {op.name}: {e}") from None
        if device is not None and device.split(":")[0] not in op.devices:
            raise Glm5Error(f"{where}: operator {op.name} runs on {' or '.join(op.devices)}, not {device}")
    recursive = entry.get("recursive", True)
    if not isinstance(recursive, bool):
        raise Glm5Error(f"{where}: recursive must be true or false, got {recursive!r}")
    return Rule(index, pattern, cls, op, device, kwargs, recursive)


def resolve_rules_path(name: str | Path) -> Path:
    """A rule file path, or the name of a shipped one (`glm5-cpu` or `glm5-cpu.yaml`)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = resources.files("glm5_offload") / "rules"
    for candidate in (str(name), f"{name}.yaml"):
        if "/" not in candidate and (shipped / candidate).is_file():
            return Path(str(shipped / candidate))
    what = "a folder, not a rule file" if path.is_dir() else "not a rule file" if path.exists() else "no such rule file"
    raise Glm5Error(f"{name}: {what} (shipped: {', '.join(shipped_rule_names())})")


def shipped_rule_names() -> list[str]:
    shipped = resources.files("glm5_offload") / "rules"
    return sorted(p.name for p in shipped.iterdir() if p.name.endswith(".yaml"))


class _NoAliases(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing aliases (*name): a rule file is a few lines, and aliases of aliases make a
    small file a structure of billions of values (the "billion laughs"), which an error message's repr then writes
    out."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.MarkedYAMLError(problem=f"an alias (*{event.anchor}): rule files take none, write the value "
                                       "out", problem_mark=event.start_mark)
        return super().compose_node(parent, index)


def load_rules(path: str | Path) -> RuleFile:
    path = resolve_rules_path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise Glm5Error(f"{path}: not UTF-8 text (byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_NoAliases)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f":{mark.line + 1}" if mark else ""
        raise Glm5Error(f"{path}{line}: malformed YAML ({e.problem or e.context})") from None
    except yaml.YAMLError as e:
        raise Glm5Error(f"{path}: malformed YAML ({e})") from None
    if data is None:
        raise Glm5Error(f"{path}: empty rule file (expected a list of rules)")
    if not isinstance(data, list):
        raise Glm5Error(f"{path}: a rule file is a YAML list of rules, got a {type(data).__name__}")
    default_device, models = None, None
    if data and isinstance(data[0], dict) and "default" in data[0]:
        where = f"{path}: rule 1 (default)"
        _check_keys(where, data[0], {"default"}, "the default entry")
        _check_keys(where, data[0]["default"], {"device", "models"}, "default")
        default_device = check_device(where, data[0]["default"].get("device"))
        models = data[0]["default"].get("models")
        if models is not None and (not isinstance(models, list) or not models
                                   or any(m not in MODEL_TYPES for m in models)):
            raise Glm5Error(f"{where}: models must list model families among {', '.join(MODEL_TYPES)}, got {models!r}")
    offset = 1 if default_device is not None else 0
    rules = []
    for i, entry in enumerate(data[offset:], start=offset + 1):
        if isinstance(entry, dict) and "default" in entry:
            raise Glm5Error(f"{path}: rule {i}: 'default' may only be the first entry")
        rules.append(_parse_rule(f"{path}: rule {i}", i, entry))
    if not rules:
        raise Glm5Error(f"{path}: empty rule file (no rules)")
    return RuleFile(str(path), default_device, tuple(rules), None if models is None else tuple(models))


@dataclass
class Placement:
    rules: RuleFile | None
    default_device: str
    slots: dict[str, Slot]
    unmatched: list[str]  # slots placed by the default (no rule matched them or an ancestor)
    unused_rules: list[Rule]  # rules that matched no module

    def devices(self) -> list[str]:
        return sorted({s.device for s in self.slots.values()})

    def table(self, dtype: torch.dtype) -> str:
        """module pattern -> operator -> device -> format -> bytes, totals per device, each layer's cache, and the
        flags."""
        groups: dict[tuple, list] = {}
        caches: dict[tuple, list[int]] = {}
        for slot in self.slots.values():
            layer = _layer(slot.name)
            held = slot.op.weights_device(slot)
            device = slot.device if held == slot.device else f"{slot.device} (weights on {held})"
            key = (_pattern(slot.name), slot.op.name, device, slot.op.format(slot, dtype), slot.rule)
            groups.setdefault(key, []).append((layer, slot))
            note = slot.op.cache_note(slot, dtype)
            if note is not None:
                caches.setdefault(note, []).append(layer)
        rows = []
        totals: dict[str, int] = {}
        for (pattern, op, device, fmt, rule), members in groups.items():
            size = sum(s.op.weight_bytes(s, dtype) for _, s in members)
            held = members[0][1].op.weights_device(members[0][1])
            totals[held] = totals.get(held, 0) + size
            rows.append((_with_layers(pattern, [i for i, _ in members if i is not None]), op, device, fmt,
                         human_bytes(size), "default" if rule is None else f"rule {rule}"))
        header = ("module", "operator", "device", "format", "weights", "placed by")
        widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
        fmt_row = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
        lines = [fmt_row(header), fmt_row(tuple("-" * w for w in widths))] + [fmt_row(r) for r in rows]
        lines.append("")
        lines += [f"total on {d}: {human_bytes(n)} ({n} bytes)" for d, n in sorted(totals.items())]
        lines += [f"{what} of layers {{{ranges(layers)}}}: {how}" for (what, how), layers in caches.items()]
        unmatched: dict[tuple, list[int]] = {}
        for name in self.unmatched:
            layer = _layer(name)
            unmatched.setdefault((_pattern(name), self.slots[name].device), []).extend([] if layer is None else [layer])
        for (pattern, device), layers in unmatched.items():
            lines.append(f"warning: no rule matched {_with_layers(pattern, layers)}: default operator on {device}")
        for rule in self.unused_rules:
            lines.append(f"warning: rule {rule.index} ({rule.describe()}) matched nothing")
        return "\n".join(lines)


_LAYER_IN_NAME = re.compile(r"\.layers\.(\d+)\.")


def _layer(name: str) -> int | None:
    layer = _LAYER_IN_NAME.search(name)
    return int(layer.group(1)) if layer else None


def _pattern(name: str) -> str:
    return _LAYER_IN_NAME.sub(".layers.{L}.", name, count=1)


def _with_layers(pattern: str, layers: list[int]) -> str:
    return pattern.replace("{L}", "{" + ranges(layers) + "}") if layers else pattern


def place(tree: nn.Module, rules: RuleFile | None, device: str | None = None) -> Placement:
    """Walk the (meta) module tree of a CausalLM and give every slot its operator and device.

    device (the --device flag) is where to run what the rules put on a GPU, and what no rule places: cuda:1 moves the
    GPU's part to GPU 1; cpu runs the whole placement on the CPU, each operator that cannot run there replaced by
    its class's reference operator (with the kwargs they share), so any rule file can be tried without a GPU."""
    model_type = tree.config.model_type
    if rules is not None and rules.models is not None and model_type not in rules.models:
        raise Glm5Error(f"{rules.path}: the rule file suits {', '.join(rules.models)}, not {model_type}")
    if device is not None:
        check_device("device", device)
    default = device or (rules.default_device if rules else None) or "cpu"
    slots: dict[str, Slot] = {}
    hits: set[int] = set()

    def visit(name: str, module: nn.Module, inherited: tuple | None, free: bool, parent: Slot | None):
        rule = None
        if rules is not None and not free:
            rule = next((r for r in rules.rules if r.matches(name, module)), None)
        if rule is not None:
            hits.add(rule.index)
        on = (rule.device if rule and rule.device else None) or (inherited[0] if inherited else None)
        if on is not None and device is not None and on.startswith("cuda"):
            on = device
        source = rule.index if rule else (inherited[1] if inherited else None)
        op = DEFAULT_OP.get(type(module))
        kwargs = rule.kwargs if rule and rule.op else None
        if rule and rule.op:
            if rule.op.replaces is not type(module):
                raise Glm5Error(f"{rules.path}: rule {rule.index}: operator {rule.op.name} replaces "
                                f"{rule.op.replaces.__name__}, but matched {name} ({type(module).__name__}); "
                                "add a 'class' to the match")
            op = rule.op
            if (on or default).split(":")[0] not in op.devices:
                if device is None:
                    raise Glm5Error(f"{rules.path}: rule {rule.index}: operator {op.name} runs on "
                                    f"{' or '.join(op.devices)}, not {on or default}")
                op = DEFAULT_OP[op.replaces]  # --device moved it where only its reference runs
                kwargs = op.parse_kwargs({k: v for k, v in kwargs.items() if k in op.kwargs})
        children = list(module.named_children())
        if op is not None:
            kwargs = op.parse_kwargs({}) if kwargs is None else kwargs
            slot = slots[name] = Slot(name, module, op, on or default, kwargs, source, parent)
            if parent is not None:
                parent.children[name.removeprefix(parent.name + ".")] = slot
            parent = slot
            children = [(n, m) for n, m in children if isinstance(m, op.delegates)]
        inherit = (on, source) if on is not None or source is not None else None
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child, inherit,
                  free or (rule is not None and not rule.recursive), parent)

    visit("", tree, None, False, None)
    for slot in slots.values():
        try:
            slot.op.check(slot)
        except Glm5Error as e:
            where = f"{rules.path}: rule {slot.rule}" if rules is not None and slot.rule is not None else "default"
            raise Glm5Error(f"{where}: {slot.op.name} on {slot.name}: {e}") from None
    unmatched = [n for n, s in slots.items() if s.rule is None]
    unused = [r for r in (rules.rules if rules else ()) if r.index not in hits]
    return Placement(rules, default, slots, unmatched, unused)


def check_devices_present(placement: Placement):
    """Refuse, before anything is loaded, a placement on a device this machine does not have."""
    for device in placement.devices():
        if device == "cpu":
            continue
        index = int(device.split(":")[1]) if ":" in device else 0
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            have = f"{torch.cuda.device_count()} CUDA device(s)" if torch.cuda.is_available() else "no CUDA"
            rule = next((s.rule for s in placement.slots.values() if s.device == device), None)
            where = f"{placement.rules.path}: rule {rule}" if placement.rules and rule else "default device"
            raise Glm5Error(f"{where}: device {device} is not present on this machine ({have})")
