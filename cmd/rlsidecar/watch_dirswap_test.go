package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// The rules' directory replaced by rename, the old one then deleted (a deploy that
// builds the new directory beside the old one and swaps it in): each swap is read, and
// reports no error. Before, fsnotify's failed removal of the old directory's watch
// (EINVAL: the kernel had dropped it with the directory) reached the log as a warning,
// "watching the rules file: invalid argument", at most swaps.
func TestWatchConfigDirSwappedReportsNoError(t *testing.T) {
	top := t.TempDir()
	etc := filepath.Join(top, "etc")
	must(t, os.Mkdir(etc, 0o755))
	config := writeFile(t, etc, "rules.yaml", "0")
	loads := make(chan string, 100)
	var mu sync.Mutex
	var errs []error
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	_, err := watchConfig(ctx, config, 20*time.Millisecond, func(bool) bool {
		b, _ := os.ReadFile(config)
		loads <- string(b)
		return false
	}, func(err error) {
		mu.Lock()
		errs = append(errs, err)
		mu.Unlock()
	})
	must(t, err)
	wait := awaitLoad(t, loads)
	for i := 1; i <= 5; i++ {
		next, old := filepath.Join(top, "etc.new"), filepath.Join(top, "etc.old")
		must(t, os.Mkdir(next, 0o755))
		writeFile(t, next, "rules.yaml", fmt.Sprint(i))
		must(t, os.Rename(etc, old))
		must(t, os.Rename(next, etc))
		must(t, os.RemoveAll(old))
		wait(fmt.Sprint(i), fmt.Sprintf("swap %d", i))
	}
	mu.Lock()
	defer mu.Unlock()
	if len(errs) > 0 {
		t.Errorf("%d errors reported: %v", len(errs), errs)
	}
}
