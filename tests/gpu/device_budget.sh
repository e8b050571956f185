# The device run's clock, sourced by tests/gpu/serve_device.sh (and tests/gpu/test_device_budget.py): one call
# of the device tool lasts at most 600 s and a killed call returns neither its stop nor its logs, so every
# stage is fitted under one deadline. The caller sets T0 (the run's start, epoch seconds), DEADLINE_S (seconds
# after T0 by which every stage has ended; the stop and the logs come after it) and S (the summary file).

say() { echo "$*" | tee -a "$S"; }
elapsed() { echo $(( $(date +%s) - T0 )); }
phase() { say "== $1 at +$(elapsed) s"; }
# result NAME RC: the summary's "NAME rc=RC" line; a stage that failed joins FAILED (the run's exit status and
# whether Ray's logs are kept: read from here, not from the summary, where a commit's subject may say rc=1).
result() {
  say "$1 rc=$2"
  [ "$2" = 0 ] || FAILED="${FAILED:-}$1 "
}

# stage NAME NOMINAL MIN [KEEP]: sets LIMIT to NOMINAL seconds, or to what is left before the deadline once
# KEEP seconds are set aside (the least that the stages of more value after this one need, and the stop while
# a server runs), whichever is less. Returns 1, with a summary line and NAME added to SKIPPED, when less than
# MIN seconds would be left: the stage is skipped.
stage() {
  local t left
  t=$(elapsed)
  left=$(( DEADLINE_S - t - ${4:-0} ))
  if [ "$left" -lt "$3" ]; then
    say "== $1 SKIPPED at +$t s: $left s left for it before the deadline (+$DEADLINE_S s), it needs $3"
    SKIPPED="${SKIPPED:-}$1 "
    return 1
  fi
  LIMIT=$(( left < $2 ? left : $2 ))
  say "== $1 at +$t s (limit $LIMIT s)"
}
