package mesh

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

// memberlistLogger adapts memberlist's *log.Logger output to slog: its
// "[DEBUG]", "[INFO]", "[WARN]" and "[ERR]"/"[ERROR]" prefixes become slog
// levels and the "memberlist: " prefix becomes the component attribute.
// Lines that say a peer's gossip could not be decrypted go to auth (when
// not nil) instead. Memberlist logs some errors once per packet or stream,
// with text the sender chose (a label, a node name), so every line is
// sanitised (printable, at most maxLineLen bytes), a warning or error is
// logged at most once a minute per kind (its fixed leading words) with the
// count, the rest at debug, and an error about input from a remote
// address (" from=") is demoted to a warning: it is the sender's problem.
// While closing (when not nil) reports true, a line that says only that a
// socket was closed under a read or write is the shutdown itself, not an
// error, and goes to debug.
func memberlistLogger(l *slog.Logger, auth *authFailures, closing func() bool) *log.Logger {
	w := &slogWriter{log: l.With("component", "memberlist"), auth: auth, now: time.Now, closing: closing}
	w.limit.every = time.Minute
	return log.New(w, "", 0)
}

type slogWriter struct {
	log   *slog.Logger
	auth  *authFailures
	now   func() time.Time
	limit rateLimiter // by lineKind
	// closing reports that the mesh is shutting down; nil: never.
	closing func() bool
}

// closedConnText is how a read or write on a socket closed under it
// (net.ErrClosed) reads in memberlist's lines.
var closedConnText = net.ErrClosed.Error()

// maxLineLen bounds a memberlist line as logged.
const maxLineLen = 300

var levelPrefixes = []struct {
	prefix []byte
	level  slog.Level
}{
	{[]byte("[DEBUG]"), slog.LevelDebug},
	{[]byte("[INFO]"), slog.LevelInfo},
	{[]byte("[WARN]"), slog.LevelWarn},
	{[]byte("[ERR]"), slog.LevelError},
	{[]byte("[ERROR]"), slog.LevelError},
}

// Write takes one line: log.Logger calls Write once per Printf.
func (w *slogWriter) Write(p []byte) (int, error) {
	n := len(p)
	msg, level := parseMemberlistLine(p)
	remote := strings.Contains(msg, " from=")
	msg = sanitize(msg, maxLineLen)
	ctx := context.Background()
	if w.auth != nil {
		if addr, ok := parseAuthFailure(msg); ok {
			w.auth.failed(addr)
			level = slog.LevelDebug // the original line, for whoever wants the detail
		}
	}
	if level >= slog.LevelWarn && w.closing != nil && strings.Contains(msg, closedConnText) && w.closing() {
		level = slog.LevelDebug // the shutdown closed the socket under a read
	}
	if level >= slog.LevelWarn {
		if level > slog.LevelWarn && remote {
			level = slog.LevelWarn
		}
		held, ok := w.limit.allow(lineKind(msg), w.now())
		if !ok {
			level = slog.LevelDebug
		} else if held > 1 {
			msg += fmt.Sprintf(" (%d such lines in the last minute, the others at debug)", held)
		}
	}
	if w.log.Enabled(ctx, level) {
		w.log.Log(ctx, level, msg)
	}
	return n, nil
}

// lineKind is the fixed leading words of a memberlist line (its format
// string up to the first value), which the sender cannot choose.
func lineKind(msg string) string {
	i := 0
	for i < len(msg) && i < 48 {
		c := msg[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c == ' ' || c == '/' || c == '-') {
			break
		}
		i++
	}
	return msg[:i]
}

// sanitize makes text from outside safe to log: valid UTF-8, control
// characters replaced with '?', at most max bytes (cut marked with "...").
func sanitize(s string, max int) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || unicode.IsControl(r) {
			clean = false
			break
		}
	}
	if clean && len(s) <= max {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if r == utf8.RuneError || unicode.IsControl(r) {
			r = '?'
		}
		if b.Len()+utf8.RuneLen(r) > max-3 {
			b.WriteString("...")
			break
		}
		b.WriteRune(r)
	}
	return b.String()
}

// parseMemberlistLine splits a memberlist log line into its message and
// level; a line without a known prefix is logged at info.
func parseMemberlistLine(p []byte) (string, slog.Level) {
	p = bytes.TrimSpace(p)
	level := slog.LevelInfo
	for _, lp := range levelPrefixes {
		if bytes.HasPrefix(p, lp.prefix) {
			level = lp.level
			p = bytes.TrimSpace(p[len(lp.prefix):])
			break
		}
	}
	p = bytes.TrimPrefix(p, []byte("memberlist: "))
	return string(p), level
}

// authFailures turns failures to authenticate gossip (the guard's, and
// memberlist's complaints about streams it dialled) into one clear warning
// per remote host a minute, and counts every one. Both the per-host state
// and the lines are bounded: at most maxAuthSources hosts are tracked
// (entries expire after a minute) and at most maxAuthLines hosts are
// named a minute; past that one line says that more are failing, so that
// packets from 50,000 spoofed sources make a handful of lines, not 50,000.
type authFailures struct {
	log   *slog.Logger
	count prometheus.Counter
	now   func() time.Time
	limit rateLimiter // by host; every and maxKeys set by the owner

	mu     sync.Mutex // guards the fields below
	window time.Time  // start of the current minute of lines
	lines  int        // hosts named in the window
	more   bool       // the "more sources" line went out in the window
}

// Bounds of authFailures.
const (
	maxAuthSources = 256
	maxAuthLines   = 8
)

// The memberlist errors (v0.7.0, net.go and security.go) that mean the
// other side has no or another key. Every "Decrypt packet failed" line
// (a UDP packet) means that too.
var authErrors = []string{
	"no installed keys could decrypt the message",                // another key
	"encryption is configured but remote state is not encrypted", // they have none, we have one
	"remote state is encrypted and encryption is not configured", // they have one, we have none
	"unsupported encryption version",                             // a plaintext packet where we expect ciphertext
	"payload is too small to decrypt",
	"cannot decrypt empty payload",
}

// parseAuthFailure recognises a memberlist line about gossip that could
// not be decrypted and returns the remote peer it names: ip:port for a
// packet (from the peer's gossip port) or a join (its gossip address),
// the ip alone for an incoming stream (whose port is ephemeral), the node
// name for a push-pull.
func parseAuthFailure(msg string) (string, bool) {
	packet := strings.HasPrefix(msg, "Decrypt packet failed: ")
	if !packet && !slices.ContainsFunc(authErrors, func(e string) bool { return strings.Contains(msg, e) }) {
		return "", false
	}
	if i := strings.LastIndex(msg, " from="); i >= 0 {
		from := msg[i+len(" from="):]
		ap, err := netip.ParseAddrPort(from)
		switch {
		case err != nil:
			return from, true // "<unknown address>"
		case packet:
			return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()).String(), true
		}
		return ap.Addr().Unmap().String(), true
	}
	if rest, ok := strings.CutPrefix(msg, "failed to join "); ok {
		if addr, _, ok := strings.Cut(rest, ": "); ok {
			return addr, true
		}
	}
	if rest, ok := strings.CutPrefix(msg, "Push/Pull with "); ok {
		if name, _, ok := strings.Cut(rest, " failed"); ok {
			return name, true
		}
	}
	return "<unknown address>", true
}

// failed counts one failure from addr and logs it unless a line about the
// same host went out less than a minute ago, or maxAuthLines hosts were
// named this minute already.
func (a *authFailures) failed(addr string) {
	a.count.Inc()
	host := addr
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		host = ap.Addr().String()
	}
	now := a.now()
	n, ok := a.limit.allow(host, now)
	if !ok {
		return
	}
	every := a.limit.every
	a.mu.Lock()
	if now.Sub(a.window) >= every {
		a.window, a.lines, a.more = now, 0, false
	}
	if a.lines >= maxAuthLines {
		first := !a.more
		a.more = true
		a.mu.Unlock()
		if first {
			a.log.Warn(fmt.Sprintf("more than %d hosts failed gossip authentication within %s; not naming each (count: weft_mesh_auth_failures_total). Many sources at once is a flood or spoofing, not a misconfigured node", maxAuthLines, every))
		}
		return
	}
	a.lines++
	a.mu.Unlock()
	a.log.Warn(fmt.Sprintf("peer %s failed authentication: wrong or missing password (check --password-file on both sides)", sanitize(addr, 64)),
		"peer-address", sanitize(addr, 64), "failures", n)
}
