package main

import (
	"context"
	"errors"
	"log/slog"
	"strings"
)

// clientGoLogger is the logger client-go's klog writes to: the router's
// log, marked component=client-go, through clientGoLog.
func clientGoLogger(log *slog.Logger) *slog.Logger {
	return slog.New(clientGoLog{log.Handler()}).With("component", "client-go")
}

// clientGoLog is the handler client-go's klog writes through. It passes
// every record on, except one: an error whose only cause is that the
// router's own context was canceled (client-go logs "Unexpected error when
// reading response body ... context canceled" at ERROR when the router
// stops while a watch is open). That is the stop the operator asked for,
// not a fault, so it is logged at DEBUG: an ERROR line in a router's log
// always means something to look at.
type clientGoLog struct{ slog.Handler }

func (h clientGoLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelError && onlyCanceled(r) {
		r.Level = slog.LevelDebug
		if !h.Handler.Enabled(ctx, r.Level) {
			return nil
		}
	}
	return h.Handler.Handle(ctx, r)
}

func (h clientGoLog) WithAttrs(as []slog.Attr) slog.Handler {
	return clientGoLog{h.Handler.WithAttrs(as)}
}

func (h clientGoLog) WithGroup(name string) slog.Handler {
	return clientGoLog{h.Handler.WithGroup(name)}
}

// onlyCanceled reports whether r carries an "err" attribute (where logr
// puts klog.ErrorS's error) that is a canceled context.
func onlyCanceled(r slog.Record) bool {
	found := false
	r.Attrs(func(a slog.Attr) bool {
		if a.Key != "err" {
			return true
		}
		switch v := a.Value.Any().(type) {
		case error:
			found = errors.Is(v, context.Canceled) || strings.HasSuffix(v.Error(), context.Canceled.Error())
		case string:
			found = strings.HasSuffix(v, context.Canceled.Error())
		}
		return false
	})
	return found
}
