package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/fsnotify/fsnotify"
)

// watchConfig calls onChange, debounced, whenever the rules file at path may have
// changed, until ctx ends. It watches the file's directory, not the file: editors and
// Kubernetes ConfigMaps replace files by rename and symlink swap, which a watch on the
// file itself would lose after the first change.
func watchConfig(ctx context.Context, path string, debounce time.Duration, onChange func(), onErr func(error)) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("watching %s: %w", path, err)
	}
	dir := filepath.Dir(path)
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		dir = path // --config DIR: its files come and go
	}
	if err := w.Add(dir); err != nil {
		w.Close()
		return fmt.Errorf("watching %s: %w", dir, err)
	}
	go func() {
		defer w.Close()
		var timer *time.Timer
		var fire <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				if timer != nil {
					timer.Stop()
				}
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if ev.Op == fsnotify.Chmod {
					continue
				}
				if timer == nil {
					timer = time.NewTimer(debounce)
				} else {
					timer.Reset(debounce)
				}
				fire = timer.C
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				onErr(err)
			case <-fire:
				fire = nil
				onChange()
			}
		}
	}()
	return nil
}
