package redistest

import "testing"

func TestEvalCallsIn(t *testing.T) {
	info := "# Commandstats\r\ncmdstat_get:calls=7,usec=3\r\ncmdstat_evalsha:calls=12,usec=40,usec_per_call=3.3\r\ncmdstat_eval:calls=3,usec=9\r\n"
	if n, err := evalCallsIn(info); n != 15 || err != nil {
		t.Fatalf("evalCallsIn = %d, %v; want 15", n, err)
	}
	if _, err := evalCallsIn("cmdstat_eval:calls=x,usec=1\r\n"); err == nil {
		t.Fatal("a malformed calls= was accepted")
	}
}
