package mesh

import (
	"bytes"
	"context"
	"fmt"
	"log"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// memberlistLogger adapts memberlist's *log.Logger output to slog: its
// "[DEBUG]", "[INFO]", "[WARN]" and "[ERR]"/"[ERROR]" prefixes become slog
// levels and the "memberlist: " prefix becomes the component attribute.
// Lines that say a peer's gossip could not be decrypted go to auth (when
// not nil) instead.
func memberlistLogger(l *slog.Logger, auth *authFailures) *log.Logger {
	return log.New(&slogWriter{log: l.With("component", "memberlist"), auth: auth}, "", 0)
}

type slogWriter struct {
	log  *slog.Logger
	auth *authFailures
}

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
	ctx := context.Background()
	if w.auth != nil {
		if addr, ok := parseAuthFailure(msg); ok {
			w.auth.failed(addr)
			level = slog.LevelDebug // the original line, for whoever wants the detail
		}
	}
	if w.log.Enabled(ctx, level) {
		w.log.Log(ctx, level, msg)
	}
	return n, nil
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

// authFailures turns memberlist's complaints about gossip that was not
// encrypted with our key into one clear warning per remote address a
// minute, and counts every one.
type authFailures struct {
	log   *slog.Logger
	count prometheus.Counter
	now   func() time.Time
	limit rateLimiter
}

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
// same host went out less than a minute ago.
func (a *authFailures) failed(addr string) {
	a.count.Inc()
	host := addr
	if ap, err := netip.ParseAddrPort(addr); err == nil {
		host = ap.Addr().String()
	}
	if n, ok := a.limit.allow(host, a.now()); ok {
		a.log.Warn(fmt.Sprintf("peer %s failed authentication: wrong or missing password (check --password-file on both sides)", addr),
			"peer-address", addr, "failures", n)
	}
}
