package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"
)

// defaultStopWithin bounds how long the supervisor waits for one
// component to stop before it goes on with the next.
const defaultStopWithin = 5 * time.Second

// component is one long-running part of a running router, with a name for
// the logs.
type component struct {
	name string
	// start, if set, runs before the next component is started (what the
	// components after this one rely on: the mesh is started before the
	// allocator sends on it). An error stops what was started and is
	// Run's error.
	start func(ctx context.Context) error
	// run runs until ctx ends. An error stops the router; nil before ctx
	// ends means the component's work is done, and the others go on. Nil
	// run: the component only waits for ctx (it has start and stop).
	run func(ctx context.Context) error
	// stop, if set, is called at shutdown once ctx is cancelled, e.g. to
	// shut a server down or close a device; its ctx ends at the bound.
	stop func(ctx context.Context) error
	// within bounds the component's shutdown; zero: defaultStopWithin.
	// A component that does not stop in time is logged and left behind
	// (the process is exiting).
	within time.Duration
}

// errStop is the cause of a supervisor's stop that is not a failure: it
// returns nil for it. (Wrap it to say why.)
var errStop = errors.New("stop requested")

// supervise starts comps in order and runs them until ctx ends or one of
// them fails, then stops them in reverse order, each within its bound. It
// returns the first component's error (with its name), nil when ctx ended,
// or the error wrapping errStop that a component returned to end the run.
func supervise(ctx context.Context, log *slog.Logger, comps []component) error {
	ctx, fail := context.WithCancelCause(ctx)
	defer fail(nil)

	type running struct {
		c      component
		cancel context.CancelFunc
		done   chan struct{}
	}
	var started []running
	for _, c := range comps {
		// A component's context ends when it is its turn to stop, not
		// when the run ends: shutdown goes in reverse order.
		cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		rc := running{c: c, cancel: cancel, done: make(chan struct{})}
		if c.start != nil {
			if err := c.start(cctx); err != nil {
				cancel()
				fail(componentError{fmt.Errorf("%s: %w", c.name, err)})
				break
			}
		}
		started = append(started, rc)
		go func() {
			defer close(rc.done)
			if c.run == nil {
				<-cctx.Done()
				return
			}
			err := c.run(cctx)
			switch {
			case err != nil && cctx.Err() == nil:
				if !errors.Is(err, errStop) {
					err = fmt.Errorf("%s: %w", c.name, err)
				}
				fail(componentError{err})
			case err != nil:
				log.Warn("stopping "+c.name, "err", err)
			case cctx.Err() == nil:
				log.Debug(c.name + ": done")
			}
		}()
	}

	<-ctx.Done()
	cause := context.Cause(ctx)
	for i := len(started) - 1; i >= 0; i-- {
		rc := started[i]
		within := rc.c.within
		if within <= 0 {
			within = defaultStopWithin
		}
		sctx, cancel := context.WithTimeout(context.Background(), within)
		rc.cancel()
		stopped := make(chan struct{})
		go func() {
			defer close(stopped)
			if rc.c.stop != nil {
				if err := rc.c.stop(sctx); err != nil {
					log.Warn("stopping "+rc.c.name, "err", err)
				}
			}
			<-rc.done
		}()
		select {
		case <-stopped:
		case <-sctx.Done():
			log.Warn(fmt.Sprintf("%s did not stop within %s; going on without it", rc.c.name, within))
		}
		cancel()
	}
	var ce componentError
	if !errors.As(cause, &ce) {
		return nil // ctx ended
	}
	return ce.err
}

// componentError is the cause of a stop that a component made.
type componentError struct{ err error }

func (e componentError) Error() string { return e.err.Error() }
