"""The web dashboard of a coordinator's run: ``robust coordinator start --dashboard``, ``robust
demo --dashboard`` and ``robust dashboard DIR``. :mod:`.view` reads a run folder into the JSON
documents of the API, :mod:`.server` serves them and the page (``static/``) read-only."""
