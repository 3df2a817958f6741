package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// writeInPlace truncates the file at name and writes s into it, as cp, an editor that
// writes in place, or a write on the host of a file bind-mounted into a container does:
// the file keeps its inode.
func writeInPlace(t *testing.T, name, s string) {
	t.Helper()
	f, err := os.OpenFile(name, os.O_WRONLY|os.O_TRUNC, 0)
	must(t, err)
	_, err = f.WriteString(s)
	must(t, err)
	must(t, f.Close())
}

// The rules file written in place through another name: a file bind-mounted into a
// container (docker run -v ./rules.yaml:/etc/rlsidecar/rules.yaml, written on the host),
// or a hard link. inotify tells a write to the watchers of the file and of the directory
// of the name it was written through, not of the directory the daemon watches: such a
// write was never seen, and the rules in force stayed until a SIGHUP. The file itself is
// watched too now, after a rename over it as well (its new inode), and each file of
// --config DIR.
func TestWatchConfigWrittenThroughAnotherName(t *testing.T) {
	for _, dirMode := range []bool{false, true} {
		name := "file"
		if dirMode {
			name = "dir"
		}
		t.Run(name, func(t *testing.T) {
			top := t.TempDir()
			etc, host := filepath.Join(top, "etc"), filepath.Join(top, "host")
			must(t, os.Mkdir(etc, 0o755))
			must(t, os.Mkdir(host, 0o755))
			config := writeFile(t, etc, "rules.yaml", "a")
			watched := config
			if dirMode {
				watched = etc
			}
			other := filepath.Join(host, "rules.yaml")
			must(t, os.Link(config, other))
			wait := watchReads(t, watched, func() string {
				b, _ := os.ReadFile(config)
				return string(b)
			})

			writeInPlace(t, other, "b")
			wait("b", "a write through a hard link in another directory")
			// Replaced by rename (a new inode), then written through a link to that one.
			must(t, os.Rename(writeFile(t, etc, ".t", "c"), config))
			wait("c", "the file renamed over")
			must(t, os.Remove(other))
			must(t, os.Link(config, other))
			writeInPlace(t, other, "d")
			wait("d", "a write through a hard link to the new file")
		})
	}
}

// The same through a bind mount of the file, as a container runtime makes it: needs
// root (mount --bind); skipped otherwise.
func TestWatchConfigBindMountedFile(t *testing.T) {
	top := t.TempDir()
	etc, host := filepath.Join(top, "etc"), filepath.Join(top, "host")
	must(t, os.Mkdir(etc, 0o755))
	must(t, os.Mkdir(host, 0o755))
	src := writeFile(t, host, "rules.yaml", "a")
	config := writeFile(t, etc, "rules.yaml", "")
	if out, err := exec.Command("mount", "--bind", src, config).CombinedOutput(); err != nil {
		t.Skipf("cannot bind-mount here (needs root): %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("umount", config).Run() })
	wait := watchReads(t, config, func() string {
		b, _ := os.ReadFile(config)
		return string(b)
	})
	writeInPlace(t, src, "b")
	wait("b", "a write on the host's side of the mount")
	writeInPlace(t, config, "c")
	wait("c", "a write through the mount")
}
