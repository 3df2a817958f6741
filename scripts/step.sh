# Sourced by scripts/test and the scripts it runs (each runs alone too). step TEXT prints
# "== TEXT (+S s)", S the whole seconds since the run began: RLSIDECAR_CI_T0, the epoch
# the first script set and exported, so a called script counts from its caller's start.
export RLSIDECAR_CI_T0="${RLSIDECAR_CI_T0:-$(date +%s)}"
step() { echo "== $* (+$(($(date +%s) - RLSIDECAR_CI_T0)) s)"; }
