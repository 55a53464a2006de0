"""The report of ``robust bench``: ``summary.md`` and ``summary.html``, their sections, tables, plots and metrics."""
