"""The ``path`` attribute: a request's path normalized as nginx's $uri is (merge_slashes
on), so that a rule on /login limits /log%69n, //login and /a/../login alike, whichever
gateway or middleware asks. The rule and its cases: clients/testdata/paths.json.

- the query and the fragment are dropped (from the first "?" or "#");
- every valid %XX is decoded, once: a decoded byte is never decoded again, and a decoded
  "/" or "." counts as one; an invalid escape stays as it is;
- runs of "/" are merged into one;
- "." and ".." segments are removed, a ".." at the root staying at the root;
- the result starts with "/" (and ends with "/" when the path did, or when its last
  segment was "." or "..").

Paths are bytes: a path is what the client sent, and need not be UTF-8.
"""

import re

_ESCAPE = re.compile(rb"%([0-9A-Fa-f]{2})")
_ABSOLUTE = re.compile(rb"[A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*")
_QUERY = re.compile(rb"[?#]")
# A target without any of these, starting with "/", is normalized already.
_WORK = re.compile(rb"[%?#]|//|/\.")


def _unescape(m):
    return bytes((int(m.group(1), 16),))


def normalize_path(target):
    """Return the ``path`` attribute (bytes) of the request target ``target`` (bytes, as
    received: ``b"/caf%C3%A9?x=1"`` gives ``b"/caf\\xc3\\xa9"``). A target in absolute form
    (``http://host/a``, as a proxy sends it) is taken from its path on, as nginx does.
    The common, normalized target is returned as it is."""
    if type(target) is not bytes:
        raise TypeError("target must be bytes, not %s" % type(target).__name__)
    if target[:1] == b"/" and _WORK.search(target) is None:
        return target
    m = _ABSOLUTE.match(target)
    if m is not None:
        target = target[m.end():]
    m = _QUERY.search(target)
    if m is not None:
        target = target[:m.start()]
    return clean_path(_ESCAPE.sub(_unescape, target))


def clean_path(path):
    """Return ``path`` (bytes, decoded already, as a server hands it to the app) with runs
    of "/" merged and "." and ".." segments removed, starting with "/". Nothing is decoded
    and nothing is cut: a "?" or a "%2e" in it is a byte of a segment like any other."""
    if type(path) is not bytes:
        raise TypeError("path must be bytes, not %s" % type(path).__name__)
    out = []
    segs = path.split(b"/")
    for seg in segs:
        if seg == b"" or seg == b".":
            continue
        if seg == b"..":
            if out:
                out.pop()
            continue
        out.append(seg)
    if not out:
        return b"/"
    tail = b"/" if segs[-1] in (b"", b".", b"..") else b""
    return b"/" + b"/".join(out) + tail


def path_attr(path):
    """The value to send for ``path`` (bytes): a str when the bytes are UTF-8 (so an
    attrs function may treat it as text), else the bytes themselves, sent as a msgpack
    bin. The daemon sees the same bytes either way; a rule on /café/** matches
    /caf%C3%A9/x."""
    try:
        return path.decode("utf-8")
    except UnicodeDecodeError:
        return path
