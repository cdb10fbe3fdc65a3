"""FP8 training (the spec's precision fp8-tensorwise | fp8-rowwise | fp8-te): what each recipe is,
which cards run it, and the bf16 stand-in the CPU trace and the pilot run instead.

Every recipe here is FP8 *compute* on top of bf16 mixed precision: fp32 master weights and
optimizer state, bf16 autocast for everything but the decoder's linear layers, whose matmuls run
in FP8 with scales (e4m3 forward, e4m3/e5m2 backward). What it changes in memory is in
plan/analytic/fp8.py; in time, the catalog's dense FP8 peak and the MFU of published FP8 runs
(cost/calibration.py).

    fp8-tensorwise  torchao Float8Linear, recipe "tensorwise": one dynamic scale per tensor; under
                    FSDP2 the weights are all-gathered in FP8 (enable_fsdp_float8_all_gather)
    fp8-rowwise     torchao Float8Linear, recipe "rowwise": one scale per row, re-cast along the
                    other axis for the weight gradient; bf16 all-gather
    fp8-te          NVIDIA Transformer Engine modules under te.fp8_autocast (delayed scaling with
                    an amax history, or per-tensor current scaling): Megatron / NeMo's FP8

FP8 needs FP8 tensor cores: Hopper (H100, H200), Ada and Blackwell, CDNA3 (MI300X). The catalog
says which cards have them (peak_tflops.fp8 null: none - A100).
"""

from __future__ import annotations

from dataclasses import dataclass

from tunepilot.errors import UserError


@dataclass(frozen=True)
class Fp8Recipe:
    """What a recipe keeps, casts and saves (the memory plan reads these)."""

    library: str
    scaling: str
    all_gather_fp8: bool
    """FSDP2 all-gathers the weights in FP8 (1 B/param) instead of bf16"""
    saves_fp8_inputs: bool
    """the forward saves its matmul inputs in FP8 for the backward, not bf16"""
    weight_cache_bytes_per_param: int
    """FP8 copies of the trained weights kept across the step (fp8 weight + its transpose)"""
    recasts: int
    """FP8 copies made of each matmul operand (rowwise re-casts along the other axis)"""
    keeps_scaling_state: bool
    """the modules keep scaling state of their own (Transformer Engine's amax history and
    scales in extra_state) that a checkpoint must save"""
    source: str
    torchao_recipe: str | None = None
    """torchao's Float8LinearConfig.from_recipe_name (None: not a torchao recipe)"""

    @property
    def own_modules(self) -> bool:
        """The recipe trains through modules of its own (Transformer Engine's te.Linear under
        te.fp8_autocast), not a patch of transformers' model (torchao's Float8Linear)."""
        return self.library.startswith("NVIDIA Transformer Engine")


RECIPES = {
    "fp8-tensorwise": Fp8Recipe(
        "torchao Float8Linear (convert_to_float8_training, recipe tensorwise)",
        "one dynamic fp32 scale per tensor", True, False, 0, 1, False,
        "pytorch/ao torchao/float8/float8_linear.py @7ca1bfbe: matmul_with_hp_or_float8_args "
        "saves input_hp and weight_hp_t (the bf16 input, the weight) and casts both to float8 in "
        "forward and again in backward; fsdp_utils.py WeightWithDynamicFloat8CastTensor "
        "all-gathers float8", torchao_recipe="tensorwise"),
    "fp8-rowwise": Fp8Recipe(
        "torchao Float8Linear (convert_to_float8_training, recipe rowwise)",
        "one fp32 scale per row (axiswise), re-cast along dim 0 for the weight gradient", False,
        False, 0, 2, False,
        "pytorch/ao torchao/float8/float8_linear.py @7ca1bfbe: the same saved tensors; axiswise "
        "casts of grad_output and input along both dims; no float8 all-gather for rowwise",
        torchao_recipe="rowwise"),
    "fp8-te": Fp8Recipe(
        "NVIDIA Transformer Engine (te.Linear / LayerNormLinear / LayerNormMLP in te.fp8_autocast)",
        "per-tensor scales from an amax history (delayed) or the current tensor", False, True,
        2, 1, True,
        "NVIDIA/TransformerEngine transformer_engine/pytorch/module/linear.py: the forward saves "
        "the FP8 cast of its input for wgrad and keeps FP8 weight workspaces (the weight and, on "
        "Hopper, its transpose) across micro-batches"),
}


def recipe(spec) -> Fp8Recipe | None:
    return spec.precision.fp8_recipe


def card_lacks_fp8(spec, card) -> str | None:
    """Why ``card`` cannot run the spec's FP8 precision (None: it can, or the spec is not FP8)."""
    if not spec.precision.is_fp8 or card.peak_flops("fp8") is not None:
        return None
    return (f"{card.name} has no FP8 tensor cores (the catalog's peak_tflops.fp8 is null), so "
            f"precision {spec.precision} cannot run on it; FP8 training needs Hopper (H100, "
            "H200), Ada or Blackwell, or CDNA3 (MI300X)")


def require_fp8_card(spec, card) -> None:
    """UserError (exit 2) when the spec is FP8 and the card has no FP8 tensor cores."""
    why = card_lacks_fp8(spec, card)
    if why:
        raise UserError("precision", why + ".",
                        "Use precision bf16-mixed on this card, or pick an H100, H200 or MI300X "
                        "(`tunepilot compare SPEC` ranks the cards that can).")


def bf16_stand_in(spec):
    """The spec with FP8 replaced by bf16-mixed: what the CPU trace and the pilot run (FP8
    kernels need FP8 tensor cores; tunepilot's own step has no FP8 path)."""
    return spec.with_changes(precision=spec.precision.stand_in) if spec.precision.is_fp8 else spec


def pilot_note(spec) -> str:
    return (f"precision {spec.precision}: FP8 is NOT measured - the pilot ran bf16-mixed (FP8 "
            "matmuls need FP8 tensor cores and tunepilot's step has no FP8 path); the quote "
            "applies the recipe's speed-up from published FP8 runs, and the plan models FP8's "
            "memory")


def stand_in_note(spec, stage: str) -> str | None:
    """What the restore proof or the scaling run of an FP8 spec did instead (None: not FP8).
    Both run tunepilot's own step, which has no FP8 path: its bf16-mixed stand-in."""
    r = spec.precision.fp8_recipe
    if r is None:
        return None
    what = {"restore": "the proof's model, optimizer, RNG and data position are those of the "
                       "bf16-mixed stand-in; "
                       + ("Transformer Engine's delayed scaling also keeps an amax history "
                          "and scales in each module's extra_state, which this proof did not "
                          "save or compare - prove it with your own loop (`tunepilot restore "
                          "--trainer hf|lightning -- CMD`) on an FP8 card"
                          if r.keeps_scaling_state else
                          "torchao's dynamic scaling keeps no state of its own, so the same "
                          "components are what an FP8 run checkpoints"),
            "scale": "its step times and efficiencies are bf16's; FP8 shortens the compute, "
                     "not the collectives, so the measured efficiency is an upper bound for "
                     "the FP8 run" + ("; FP8 all-gathers (fp8-tensorwise under FSDP) halve the "
                                      "all-gather bytes, which this run did not measure"
                                      if r.all_gather_fp8 else "")}[stage]
    return (f"precision {spec.precision}: the {stage} stage ran the bf16-mixed stand-in (FP8 "
            f"matmuls need FP8 tensor cores and tunepilot's step has no FP8 path): {what}")


def cards_for(spec, catalog, card_ids: list[str] | None) -> tuple[list, list[str]]:
    """The cards a plan of the spec fits against: an FP8 spec refuses a named card without FP8
    tensor cores (UserError) and leaves such cards out of the whole catalog, saying so."""
    cards = catalog.select(card_ids)
    if not spec.precision.is_fp8:
        return cards, []
    if card_ids:
        for card in cards:
            require_fp8_card(spec, card)
        return cards, []
    left = [c for c in cards if card_lacks_fp8(spec, c)]
    notes = [f"{c.id} left out: no FP8 tensor cores for precision {spec.precision}"
             for c in left]
    return [c for c in cards if c not in left], notes
