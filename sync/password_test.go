package sync

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The password file is read at each call: a new password is taken and announced once;
// an emptied or removed file keeps the password before it and is reported once per
// error, until the file is good again.
func TestPasswordFileReread(t *testing.T) {
	t.Setenv(PasswordEnv, "")
	name := filepath.Join(t.TempDir(), "pw")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(name, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("first-pw\r\n")
	var errs []error
	var seen []string
	f, err := LoadPasswordFile(name, func(err error) { errs = append(errs, err) }, func(p string) { seen = append(seen, p) })
	if err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		content  string // "-": the file removed
		want     string
		errs     int
		newSeen  []string
		errWants string
	}{
		{"first-pw\n", "first-pw", 0, nil, ""},
		{"second-pw\n", "second-pw", 0, []string{"second-pw"}, ""},
		{"", "second-pw", 1, []string{"second-pw"}, "is empty"},
		{"", "second-pw", 1, []string{"second-pw"}, ""},
		{"-", "second-pw", 2, []string{"second-pw"}, "no such file"},
		{"third-pw", "third-pw", 2, []string{"second-pw", "third-pw"}, ""},
		{"", "third-pw", 3, []string{"second-pw", "third-pw"}, "is empty"},
	}
	for i, s := range steps {
		if s.content == "-" {
			os.Remove(name)
		} else {
			write(s.content)
		}
		if got := f.Password(); got != s.want {
			t.Fatalf("step %d: password %q, want %q", i, got, s.want)
		}
		if len(errs) != s.errs || strings.Join(seen, ",") != strings.Join(s.newSeen, ",") {
			t.Fatalf("step %d: errors %v, new passwords %v; want %d errors, %v", i, errs, seen, s.errs, s.newSeen)
		}
		if s.errWants != "" && !strings.Contains(errs[len(errs)-1].Error(), s.errWants) {
			t.Fatalf("step %d: %v, want %q", i, errs[len(errs)-1], s.errWants)
		}
	}
	if strings.Contains(errors.Join(errs...).Error(), "-pw") {
		t.Fatalf("an error quotes a password: %v", errs)
	}
	// Both the file and the environment: refused, as before.
	t.Setenv(PasswordEnv, "env-pw")
	if _, err := LoadPasswordFile(name, nil, nil); err == nil || !strings.Contains(err.Error(), "both set") {
		t.Fatalf("file and $%s: %v", PasswordEnv, err)
	}
}
