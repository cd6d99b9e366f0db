# Reads ctest's build/Testing/Temporary/LastTest.log and prints every skipped test with the reason it gave
# (GTEST_SKIP()'s message, or a Python test's "skipped: ..." line before it exits 77), then one line of
# counts by reason. scripts/test.sh runs it after ctest.
#   awk -f scripts/skip_summary.awk build/Testing/Temporary/LastTest.log
function record() {
  if (name in seen) return
  seen[name] = 1
  if (reason == "") reason = "(no reason given)"
  skipped++
  if (!(reason in count)) order[++reasons] = reason
  count[reason]++
  printf "skipped %s: %s\n", name, reason
}
/^[0-9]+\/[0-9]+ Testing: / { name = $3; grab = 0; reason = ""; next }
grab && /^\[  SKIPPED \]/ { grab = 0; record(); next }
grab { reason = (reason == "" ? $0 : reason " " $0); next }
/: Skipped$/ { grab = 1; reason = ""; next }
/^skipped: / { reason = substr($0, 10); record(); next }
END {
  if (skipped == 0) { print "tests skipped: none"; exit }
  line = "tests skipped: " skipped " ("
  for (i = 1; i <= reasons; i++) line = line (i > 1 ? "; " : "") count[order[i]] " " order[i]
  print line ")"
}
