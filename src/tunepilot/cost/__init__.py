"""The quote (stage 5): the cost of a fixed term and the cost per useful token.

    quote         the job's time terms, the term, quote()
    compare       every card x count that fits, ranked (compare())
    throughput    useful tokens/s of one card and of N (measured, or projected by a rule)
    mfu           the MFU a projection assumes (by implementation, method and card)
    measurements  what a run directory measured, read as typed results
    terms         billed time, discounts and options in integer cents; parsing durations
    assumptions   resources/cost_model.yaml
"""

from tunepilot.cost.assumptions import cost_model
from tunepilot.cost.compare import compare
from tunepilot.cost.measurements import read_run_dir
from tunepilot.cost.quote import MEASURED, PROJECTED, SpotAsk, quote

__all__ = ["MEASURED", "PROJECTED", "SpotAsk", "compare", "cost_model", "quote", "read_run_dir"]
