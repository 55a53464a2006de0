"""The field lab (``robust field``): a scenario played as a real deployment on one machine, each
volunteer in its own network namespace behind a shaped link (``netns``, ``shaping``, ``relay``),
with its share of the CPU (``cpu``) and the scenario's churn (``lab``)."""
