package mesh

import (
	"bytes"
	"context"
	"log"
	"log/slog"
)

// memberlistLogger adapts memberlist's *log.Logger output to slog: its
// "[DEBUG]", "[INFO]", "[WARN]" and "[ERR]"/"[ERROR]" prefixes become slog
// levels and the "memberlist: " prefix becomes the component attribute.
func memberlistLogger(l *slog.Logger) *log.Logger {
	return log.New(&slogWriter{log: l.With("component", "memberlist")}, "", 0)
}

type slogWriter struct{ log *slog.Logger }

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
