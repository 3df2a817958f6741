package rules

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
)

// maxFileSize bounds a rules file. The YAML library builds a node tree of the whole file
// before a rule is looked at, costing up to about 100 bytes of memory for each byte of
// YAML (a dense flow list: 8 MiB of "1," took 820 MB and 8 s; 32 MiB, 3.4 GB), and a
// reload holds that beside the rules in force. 8 MiB is eight times a 10,000-rule file
// (about 1 MB) and admits 50,000 rules (5 MB); a file past it is most likely not a rules
// file at all (a log, a dump), and is refused before it is read.
const maxFileSize = 8 << 20

// readFile reads the rules file at path, following symlinks: what a symlink names is
// what is read, since operators deploy by symlink swap. It refuses anything but a regular
// file, and a file larger than maxFileSize, with an [Errors] naming the file, as a broken
// file is refused: a device (/dev/zero) would be read until memory ran out, and a named
// pipe would block the reload until something wrote to it, every later reload waiting
// behind it.
func readFile(path string) ([]byte, error) {
	// O_NONBLOCK: opening a named pipe for reading otherwise waits for a writer. It
	// changes nothing for a regular file, which is all that is read. Stat after opening,
	// not before: the file checked is the file read, whatever is renamed over the path
	// meanwhile.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if fi, lerr := os.Lstat(path); lerr == nil && fi.Mode()&fs.ModeSymlink != 0 {
				target, _ := os.Readlink(path)
				return nil, &danglingLink{path: path, target: target, err: err}
			}
		}
		return nil, fmt.Errorf("reading rules: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("reading rules: %w", err)
	}
	if !fi.Mode().IsRegular() {
		what := describeMode(fi.Mode())
		if target, err := filepath.EvalSymlinks(path); err == nil && target != path {
			what = target + ", " + what
		}
		return nil, Errors{{File: path, Msg: fmt.Sprintf("not a regular file (%s); a rules file must be a regular file, or a symlink to one", what)}}
	}
	if fi.Size() > maxFileSize {
		return nil, tooLarge(path, fi.Size())
	}
	// One byte past the bound, to tell a file that grew while read from one that fits.
	data, err := io.ReadAll(io.LimitReader(f, maxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading rules: %w", err)
	}
	if int64(len(data)) > maxFileSize {
		return nil, tooLarge(path, -1)
	}
	return data, nil
}

// tooLarge refuses a file of size bytes; size < 0 when the file grew past the bound
// while it was read.
func tooLarge(path string, size int64) error {
	have := "it grew past that while being read"
	if size >= 0 {
		have = fmt.Sprintf("this one holds %d", size)
	}
	return Errors{{File: path, Msg: fmt.Sprintf("too large for a rules file: at most %d bytes (%d MiB), %s; is this the rules file?", maxFileSize, maxFileSize>>20, have)}}
}

// describeMode names a file type that is not a regular file, for errors.
func describeMode(m fs.FileMode) string {
	switch t := m.Type(); {
	case t&fs.ModeDir != 0:
		return "a directory"
	case t&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case t&fs.ModeSocket != 0:
		return "a socket"
	case t&fs.ModeCharDevice != 0:
		return "a character device"
	case t&fs.ModeDevice != 0:
		return "a block device"
	default:
		return "an irregular file"
	}
}

// danglingLink is the error of reading a rules file that is a symlink whose target does
// not exist (it unwraps to fs.ErrNotExist). Before, it said only "open x.yaml: no such
// file or directory", the file being plainly there in ls.
type danglingLink struct {
	path, target string
	err          error
}

func (e *danglingLink) Error() string {
	return fmt.Sprintf("reading rules: %s is a symlink to %s, which does not exist", e.path, e.target)
}

func (e *danglingLink) Unwrap() error { return e.err }
