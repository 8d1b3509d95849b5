"""Load a checkpoint directory into a placed model: config, module tree, placement by the rules, the planner's
verdict, the checkpoint checked from its headers, then every slot built by its operator.

Nothing is read before the placement is known to fit and every tensor of the checkpoint is known to match the
model: a bad checkpoint or a placement that does not fit raises one Glm5Error, and nothing half-loaded is used.
"""

import logging
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import Checkpoint
from .config import load_config
from .errors import Glm5Error, out_of_memory_said
from .model import CausalLM, build_model
from .ops.base import BuildContext
from .planner import PlanError, detected_budgets, make_plan
from .rules import RuleFile, check_devices_present, place

log = logging.getLogger("glm5_offload")


def fuse_same_input(model, placement):
    """Each module that names the projections reading its input (SAME_INPUT: the attention's q_a_proj,
    kv_a_proj_with_mqa and indexer's wk, an MLP's gate_proj and up_proj, a KDA layer's six) gets them as one call
    (fused_inputs) where one operator placed them all on the module's own device and can fuse them (Operator.fuse).
    Trailing names it lacks (a shared layer has no indexer) are left out."""
    for name, module in model.named_modules():
        names = getattr(module, "SAME_INPUT", ())
        while names and not _has(module, names[-1]):
            names = names[:-1]
        slots = [placement.slots.get(f"{name}.{n}") for n in names]
        own = placement.slots.get(name)
        if (len(slots) < 2 or None in slots or own is None
                or {(s.op, s.device) for s in slots} != {(slots[0].op, own.device)}):
            continue
        module.fused_inputs = slots[0].op.fuse([s.module for s in slots])


def _has(module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def _to_device_hook(device: torch.device):
    """A forward pre-hook that brings every tensor argument to the operator's device."""
    def hook(module, args, kwargs):
        move = lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}
    return hook


def load_model(model_dir: str | Path, device: str | None = None, dtype: torch.dtype | None = None,
               rules: RuleFile | None = None, max_seq_len: int | None = None,
               budgets: dict[str, int | None] | None = None, kv_dtype: str | None = None) -> CausalLM:
    """config.json + safetensors in model_dir -> a ready CausalLM placed by rules.

    device: the default device (over the rule file's); dtype: compute dtype (default: the config's).
    With max_seq_len, the planner checks the placement against the memory budgets first ('cpu',
    'cuda'; this machine's where not given) and refuses what would not fit before anything is loaded.
    kv_dtype 'fp8' keeps every layer's latent rows in the FP8 form, whatever the attention rules say.
    """
    model_dir = Path(model_dir)
    config = load_config(model_dir)
    dtype = dtype or getattr(torch, config.dtype)
    model = build_model(config)
    placement = place(model, rules, device)
    check_devices_present(placement)
    for rule in placement.unused_rules:
        log.warning("%s: rule %d (%s) matched no module of this model", rules.path, rule.index, rule.describe())
    if rules is not None and placement.unmatched:
        log.warning("%s: no rule placed %d modules (%s first): their reference operators run on %s", rules.path,
                    len(placement.unmatched), placement.unmatched[0], placement.default_device)
    if max_seq_len is not None:
        config.check_positions(max_seq_len)
        limits = {k: v for k, v in (budgets or {}).items() if v is not None}
        plan = make_plan(config, placement, max_seq_len, {**detected_budgets(), **limits}, dtype=dtype, kv_dtype=kv_dtype)
        if not plan.fits:
            raise PlanError(plan)
    tied = {"lm_head.weight": "model.embed_tokens.weight"} if config.tie_word_embeddings else {}
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in tied}
    checkpoint = Checkpoint(model_dir, config, expected, aliases=tied)
    ctx = BuildContext(config, dtype, model_dir, kv_dtype, placement.slots["model.embed_tokens"].device)
    slots = list(placement.slots.values())
    for slot in tqdm(slots, desc="loading", unit="module", disable=None):
        try:
            module = slot.op.build(slot, checkpoint, ctx)
        except Glm5Error as e:
            if rules is None or slot.rule is None:
                raise
            raise Glm5Error(f"{rules.path}: rule {slot.rule} ({slot.op.name} on {slot.name}): {e}") from None
        except torch.OutOfMemoryError as e:  # the planner counts what it knows; the GPU may hold other processes'
            raise Glm5Error(f"{model_dir}: the GPU ran out of memory loading {slot.name} ({out_of_memory_said(e)}); "
                            "rules that place less on the GPU, or --gpu-mem at what is free, fit (glm5 plan shows the "
                            "budget)") from None
        if module is not slot.module:
            parent, _, child = slot.name.rpartition(".")
            setattr(model.get_submodule(parent), child, module)
            slot.module = module
    unbuilt = [n for n, t in model.state_dict().items() if t.is_meta]
    if unbuilt:
        raise RuntimeError(f"no operator built {unbuilt[0]}")
    for op in dict.fromkeys(s.op for s in slots):
        op.link([s.module for s in slots if s.op is op])
    fuse_same_input(model, placement)
    for slot in slots:  # a slot on its parent slot's device is called with its inputs there already
        if slot.parent is None or slot.parent.device != slot.device:
            slot.module.register_forward_pre_hook(_to_device_hook(torch.device(slot.device)), with_kwargs=True)
    model.placement = placement
    return model.eval()
