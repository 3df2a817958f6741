# Sourced by scripts/test and the scripts it runs (each runs alone too). step TEXT prints
# "== TEXT (+S s)", S the whole seconds since the run began: CI_STEP_T0, the epoch
# the first script set and exported, so a called script counts from its caller's start.
# (Not RLSIDECAR_*: a daemon the tests start warns of such a variable that sets no flag,
# and tests that read its log for warnings failed.)
export CI_STEP_T0="${CI_STEP_T0:-$(date +%s)}"
step() { echo "== $* (+$(($(date +%s) - CI_STEP_T0)) s)"; }
