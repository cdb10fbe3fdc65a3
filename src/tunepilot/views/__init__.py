"""Terminal views: how a person reads each result (rich tables). Library functions never print;
the CLI ends every command with ``show(result, as_json, view)``.

    common    the console, tables, figure cells (one set of formatters: tunepilot.units)
    plan      the plan as a worked example; presets; cards
    pilot     the pilot's summary and its progress bar
    restore   the restore proof, verify, export
    scale     the scaling test
    cost      quote and compare
    ledger    bookings, invoices, cancellations, usage, spend
    run       the staged pilot's gates and decision
    data      the dataset profile
    progress  progress on a terminal (a bar) or in a log (a line every few seconds)
"""
