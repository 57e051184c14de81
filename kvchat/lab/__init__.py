"""Experiments behind ``kvchat verify`` and ``kvchat bench``.

Each experiment is a function ``run(ctx: LabContext) -> Section``: it measures, writes its
plots through ``ctx.figure``, and returns tables, raw data and the claims it checked. The
runner (``kvchat.lab.runner``) writes ``results.json``, ``report.md`` and ``figures/*.png``
into the results directory, with a verdict section listing every claim that held or not.
"""
