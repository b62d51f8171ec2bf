package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"k8s.io/klog/v2"
)

// TestClientGoCanceledIsNotAnError: client-go's error about a response body
// cut by the router's own stop is logged at DEBUG (and not at all at INFO),
// while its other errors stay at ERROR. Through klog itself, as the router
// wires it.
func TestClientGoCanceledIsNotAnError(t *testing.T) {
	for _, level := range []slog.Level{slog.LevelInfo, slog.LevelDebug} {
		var buf bytes.Buffer
		klog.SetSlogLogger(clientGoLogger(slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: level}))))
		klog.ErrorS(fmt.Errorf("read body: %w", context.Canceled), "Unexpected error when reading response body")
		klog.ErrorS(errors.New("context canceled"), "Unexpected error when reading response body")
		klog.ErrorS(errors.New("connection refused"), "Failed to watch")
		klog.Flush()
		out := buf.String()
		if n := strings.Count(out, "level=ERROR"); n != 1 || !strings.Contains(out, "connection refused") {
			t.Errorf("level %v: want exactly the refused watch at ERROR, got:\n%s", level, out)
		}
		debug := strings.Count(out, "level=DEBUG")
		if want := map[slog.Level]int{slog.LevelInfo: 0, slog.LevelDebug: 2}[level]; debug != want {
			t.Errorf("level %v: %d canceled errors at DEBUG, want %d:\n%s", level, debug, want, out)
		}
	}
}
