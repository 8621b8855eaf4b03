"""Pure query functions over the telemetry store, shared by the HTML pages and the JSON API.

Each function takes an open SQLAlchemy ``Connection`` and plain arguments and returns frozen
dataclasses (with ``to_json()``); nothing here knows about Flask. One dataset, two renderings:
a view calls the function once and either renders a template (with ``admin.charts``) or
returns the JSON.

* ``runs``: runs, the candidate set pins are validated against, time ranges of a run.
* ``timeseries``: the overview's series, downsampled on the server (see its docstring).
* ``sums``: bucket sums, the row format of every downsampling tier, and bucket -> point.
* ``granules``: the in-process 10-second sums behind long ranges.
* ``shapes``: chosen shapes against batch size and acceptance; acceptance by depth and rank.
* ``costs``: predicted against measured step time and acceptance, per policy version.
* ``control``: pins, policy versions, retrain jobs and the audit log as the pages list them.
"""
