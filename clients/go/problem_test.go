package rlclient

import (
	"encoding/json"
	"flag"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
)

var updateBodies = flag.Bool("update", false, "rewrite the body of every case in clients/testdata/problem_bodies.json from WriteRejection")

// bodyVector is one entry of clients/testdata/problem_bodies.json: a decision that does
// not allow the request, and the exact status and problem+json body every client writes
// for it (the Node, Python and Lua clients' tests read the same file).
type bodyVector struct {
	headerVector
	Unreachable bool   `json:"unreachable"`
	Body        string `json:"body"`
}

const problemBodiesPath = "../testdata/problem_bodies.json"

func TestProblemBodies(t *testing.T) {
	b, err := os.ReadFile(problemBodiesPath)
	if err != nil {
		t.Fatal(err)
	}
	var vs []bodyVector
	dec := json.NewDecoder(strings.NewReader(string(b)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&vs); err != nil {
		t.Fatalf("problem_bodies.json: %v", err)
	}
	if len(vs) < 5 {
		t.Fatalf("problem_bodies.json has %d cases", len(vs))
	}
	for i := range vs {
		v := &vs[i]
		r := v.response()
		d := decision(&r)
		d.Unreachable = v.Unreachable
		rec := httptest.NewRecorder()
		WriteRejection(rec, &d)
		if *updateBodies {
			v.Body, v.Status = rec.Body.String(), rec.Code
			continue
		}
		if rec.Code != v.Status || rec.Body.String() != v.Body {
			t.Errorf("%s: %s\n got %d %s\nwant %d %s", v.Name, v.Meaning, rec.Code, rec.Body, v.Status, v.Body)
		}
		for k, want := range v.Headers {
			if got := rec.Header().Get(k); got != want {
				t.Errorf("%s: %s: %q, want %q", v.Name, k, got, want)
			}
		}
	}
	if *updateBodies {
		out, err := json.MarshalIndent(vs, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(problemBodiesPath, append(out, '\n'), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}
