"""The quote (stage 5): the cost of a fixed term and the cost per useful token.

    quote         the job's time terms, the term, quote()
    compare       every card x count that fits, ranked (compare())
    throughput    useful tokens/s of one card and of N (measured, or projected by a rule)
    mfu           the MFU a projection assumes (by implementation, method and card)
    measurements  what a run directory measured, read as typed results
    terms         billed time, discounts and options in integer cents; parsing durations
    assumptions   resources/cost_model.yaml

This file is an index only: import from the module that owns a name
(``from tunepilot.cost.quote import quote``). Re-exporting here would load the whole quote
(pydantic results, the plan) for anything that needs one module of it - the ledger's billing
terms among them - and `tunepilot book` would start 0.15 s slower.
"""
