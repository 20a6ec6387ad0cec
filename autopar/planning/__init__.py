"""The plan's room: making a plan, the Plan itself, and what is asked of a finished one.

`options.py` (every planning option, once), `planner.py` (the request's checks, the searches, the plan
they make: `plan_captured`), `result.py` (the Plan's data and `make_plan`) with its other jobs one module
each: `text.py` (`print(plan)`), `json_io.py` (to_json / from_json), `inputs.py` (a rank's share of a
batch), `schedule.py` (the buckets, layer groups and re-gathers the runtime runs); beside them
`progress.py` (a planning call's stages on stderr) and `plots.py` (pictures of a finished plan).

The folder is `planning`, not `plan`: `autopar.plan` is the public function `autopar.plan(...)`, and a
subpackage of that name would make the attribute mean two things: importing the subpackage sets it as
`autopar`'s attribute `plan`, over the function, unless the function is bound after it and hides the
subpackage from attribute lookup; then `mock.patch("autopar.plan.text.render")` and
`import autopar.plan.text; autopar.plan.text.render(...)` fail. Either way one of the two breaks.

Nothing is imported here, so importing one of these modules (the Plan, to read a plan's JSON, say) loads
what that module needs and no more: not the planner, nor the plots' matplotlib.
"""
