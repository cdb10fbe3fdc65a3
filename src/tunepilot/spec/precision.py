"""The run's precision: one object, chosen once from the user's string, that answers every
question a stage asks about it - nothing else in tunepilot compares precision strings.

    name            compute   parameters  autocast  GradScaler  peak key
    fp32            fp32      fp32        -         -           fp32
    bf16-mixed      bf16      fp32        bf16      -           bf16
    bf16-true       bf16      bf16        -         -           bf16
    fp16-mixed      fp16      fp32        fp16      yes         fp16
    fp8-tensorwise  bf16*     fp32        bf16      -           fp8
    fp8-rowwise     bf16*     fp32        bf16      -           fp8
    fp8-te          bf16*     fp32        bf16      -           fp8

* FP8 training is bf16 mixed precision with the decoder's linear layers' matmuls in FP8
(spec/fp8.py): activations, norms, attention and the loss stay bf16; the MFU is over the
card's dense FP8 peak, as NVIDIA's published FP8 MFU is. On a CPU (the pilot, the trace, the
restore proof, the scaling run) an FP8 spec runs its bf16-mixed stand-in (``stand_in``).

``Precision`` is a ``str``: the spec's YAML and JSON, the spec hash and every result that
records the precision keep the plain name (``spec.precision == "bf16-mixed"`` still holds), while
``spec.precision.compute_bytes`` reads as what it is. Pydantic validates it as the literal
choice list (an unknown name is the spec's "is not one of ..." error with a did-you-mean).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from tunepilot.spec.fp8 import RECIPES, Fp8Recipe

PrecisionName = Literal["fp32", "bf16-mixed", "bf16-true", "fp16-mixed", "fp8-tensorwise",
                        "fp8-rowwise", "fp8-te"]
NAMES: tuple[str, ...] = get_args(PrecisionName)
DtypeName = Literal["fp32", "bf16", "fp16"]

# Bytes per element by dtype name.
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# name -> (compute dtype, full-run parameter dtype, mixed: fp32 master weights + 16-bit compute)
_TABLE: dict[str, tuple[DtypeName, DtypeName, bool]] = {
    "fp32": ("fp32", "fp32", False),
    "bf16-mixed": ("bf16", "fp32", True),
    "bf16-true": ("bf16", "bf16", False),
    "fp16-mixed": ("fp16", "fp32", True),
    **{name: ("bf16", "fp32", True) for name in RECIPES},
}
assert set(_TABLE) == set(NAMES), "every precision name has one row"


class Precision(str):
    """The spec's precision (a ``str`` of one of NAMES) and everything it implies."""

    __slots__ = ()

    def __new__(cls, value: str) -> Precision:
        if isinstance(value, Precision):
            return value
        if value not in _TABLE:
            raise ValueError(f"precision {value!r} is not one of {', '.join(NAMES)}")
        return super().__new__(cls, value)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler
                                     ) -> core_schema.CoreSchema:
        """Validated as the literal name list (the spec's usual error), stored as Precision,
        written as the plain string."""
        return core_schema.no_info_after_validator_function(
            cls, core_schema.literal_schema(list(NAMES)),
            serialization=core_schema.plain_serializer_function_ser_schema(str))

    # --- what the step computes in ------------------------------------------------------
    @property
    def is_fp8(self) -> bool:
        """FP8 training: bf16-mixed with the decoder's linear layers' matmuls in FP8."""
        return self in RECIPES

    @property
    def mixed(self) -> bool:
        """fp32 parameters (the master copy) with 16-bit (or FP8) compute: *-mixed and fp8-*."""
        return _TABLE[self][2]

    @property
    def compute_dtype(self) -> DtypeName:
        """The dtype activations, KV cache, logits (before any fp32 upcast) and the matmuls
        outside FP8's linears run in."""
        return _TABLE[self][0]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype: 4 under fp32, else 2."""
        return DTYPE_BYTES[self.compute_dtype]

    @property
    def all_fp32(self) -> bool:
        """Every tensor fp32 (precision fp32): matmuls at the fp32 peak, TF32 only if allowed."""
        return self.compute_bytes == 4

    @property
    def computes_in_bf16(self) -> bool:
        """bf16 compute (bf16-*, and FP8's non-matmul work): needs a card, or CPU, with bf16."""
        return self.compute_dtype == "bf16"

    @property
    def autocast_dtype(self) -> DtypeName | None:
        """The torch.autocast dtype the step runs under (None: no autocast - fp32, bf16-true):
        the one rule for the training step, the trace, FSDP's gather dtype and generation."""
        return self.compute_dtype if self.mixed else None

    @property
    def needs_grad_scaler(self) -> bool:
        """fp16's narrow exponent needs loss scaling (a GradScaler, part of the state)."""
        return self.compute_dtype == "fp16"

    # --- what the weights are stored in -------------------------------------------------
    @property
    def parameter_dtype(self) -> DtypeName:
        """A full run's parameters (and optimizer state): bf16 under bf16-true, else fp32 (a
        mixed run keeps fp32 master weights)."""
        return _TABLE[self][1]

    @property
    def parameter_bytes(self) -> int:
        return DTYPE_BYTES[self.parameter_dtype]

    @property
    def frozen_base_dtype(self) -> DtypeName:
        """A LoRA run's frozen base, unless method.base_dtype says otherwise: loaded in the
        compute dtype (fp32 under fp32, fp16 under fp16-mixed, else bf16)."""
        return self.compute_dtype

    @property
    def frozen_copy(self) -> Precision:
        """The precision a frozen copy beside the policy (a reference or reward model) is built
        in: the compute dtype throughout, as TRL and axolotl load them (bf16 unless the run is
        fp32)."""
        return Precision("fp32" if self.all_fp32 else "bf16-true")

    # --- time ---------------------------------------------------------------------------
    @property
    def peak_key(self) -> str:
        """The catalog peak_tflops key the matmuls run at (the one peak rule of MFU): fp8 for
        FP8 training, else the compute dtype (fp32 is the fp32 peak: PyTorch keeps TF32 off for
        matmuls by default). QLoRA, refused outside bf16, computes at the bf16 peak."""
        return "fp8" if self.is_fp8 else self.compute_dtype

    @property
    def throughput_class(self) -> str:
        """The time model's precision cell: each FP8 recipe its own, every 16-bit precision
        (and fp32, rare in published runs) the bf16 cell."""
        return str(self) if self.is_fp8 else "bf16"

    @property
    def rank_loss_tolerance(self) -> float:
        """How far the same step's loss may move between rank counts, where only the order of
        the reduction differs (all-reduce of per-rank means vs one mean). fp32: eps 2^-23, so
        after a few Adam steps the differences stay near 1e-6 (1e-3 leaves room for longer
        runs); bf16 (8 bits of mantissa, eps 2^-8): a loss of ~2-10 moves by a few hundredths
        when rounding differs - more with bf16 parameters and optimizer state (bf16-true)."""
        if self.all_fp32:
            return 1e-3
        return 5e-2 if self.mixed else 1e-1

    @property
    def deepspeed_engine(self) -> Precision:
        """The precision DeepSpeed's engine trains in: its bf16 engine holds the module in bf16
        and keeps an fp32 master copy and fp32 optimizer state in the ZeRO optimizer, whatever
        dtype the model was loaded in - so bf16-true runs as bf16-mixed."""
        return Precision("bf16-mixed") if self == "bf16-true" else self

    # --- FP8 ----------------------------------------------------------------------------
    @property
    def fp8_recipe(self) -> Fp8Recipe | None:
        """The FP8 recipe (spec/fp8.py RECIPES); None for a precision that is not FP8."""
        return RECIPES.get(self)

    @property
    def stand_in(self) -> Precision:
        """What runs where FP8 cannot (a CPU pilot, the trace, the restore proof, the scaling
        run; tunepilot's own step has no FP8 path): bf16-mixed for FP8, else itself."""
        return Precision("bf16-mixed") if self.is_fp8 else self

