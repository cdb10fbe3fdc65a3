"""The run's vocabulary: the spec (run.py) and the parts every stage asks about - the method,
the objective, the kernels, FP8, and the reading of a YAML spec."""

from tunepilot.spec.parallel import DeepSpeedSpec, ParallelSpec
from tunepilot.spec.precision import Precision
from tunepilot.spec.run import (
    CHUNKED_LOSS_TOKENS,
    LITGPT_LM_HEAD_CHUNK,
    DataSpec,
    Implementation,
    RunSpec,
    load_spec,
    spec_from_dict,
)

__all__ = ["CHUNKED_LOSS_TOKENS", "LITGPT_LM_HEAD_CHUNK", "DataSpec", "DeepSpeedSpec",
           "Implementation", "ParallelSpec", "Precision", "RunSpec", "load_spec",
           "spec_from_dict"]
