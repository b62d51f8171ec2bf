package kube

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
)

// Backoff is a retry schedule: the n-th wait (from 0) is
// min(Initial·Factorⁿ, Max), shortened by a random part of up to Jitter
// (0.2: each wait is 80 to 100 % of that), so that routers that failed
// together do not retry together, and no wait is longer than Max.
type Backoff struct {
	Initial time.Duration
	Max     time.Duration
	Factor  float64
	Jitter  float64
}

// DefaultBackoff is for failed API calls: 1 s doubling to 30 s.
var DefaultBackoff = Backoff{Initial: time.Second, Max: 30 * time.Second, Factor: 2, Jitter: 0.2}

// DefaultConflictBackoff is for compare-and-swap conflicts on the
// ConfigMap: another router wrote in between, which is quick to retry.
var DefaultConflictBackoff = Backoff{Initial: 20 * time.Millisecond, Max: 2 * time.Second, Factor: 2, Jitter: 0.5}

// withDefaults fills zero fields from d.
func (b Backoff) withDefaults(d Backoff) Backoff {
	if b.Initial <= 0 {
		b.Initial = d.Initial
	}
	if b.Max <= 0 {
		b.Max = d.Max
	}
	if b.Max < b.Initial {
		b.Max = b.Initial
	}
	if b.Factor < 1 {
		b.Factor = d.Factor
	}
	if b.Jitter <= 0 || b.Jitter > 1 {
		b.Jitter = d.Jitter
	}
	return b
}

// Delay is the wait before retry number attempt (0 for the first retry);
// u in [0, 1) is the random draw of the jitter.
func (b Backoff) Delay(attempt int, u float64) time.Duration {
	d := float64(b.Initial) * math.Pow(b.Factor, float64(max(attempt, 0)))
	if d > float64(b.Max) || math.IsInf(d, 0) || math.IsNaN(d) {
		d = float64(b.Max)
	}
	return time.Duration(d * (1 - b.Jitter*u))
}

// op names one kind of API call, for logs, metrics and RBAC messages.
type op struct {
	verb, resource string // e.g. "patch", "nodes/status"
	name, ns       string // the object; ns empty for cluster-scoped ones
}

func (o op) String() string { return o.verb + " " + o.resource }

// callTimeout bounds one API request; a request that hangs counts as a
// failure and is retried.
const callTimeout = 15 * time.Second

// permanent reports whether the API server's answer will not change on
// retry: the request itself is wrong.
func permanent(err error) bool {
	return apierrors.IsInvalid(err) || apierrors.IsBadRequest(err) ||
		apierrors.IsRequestEntityTooLargeError(err) || apierrors.IsMethodNotSupported(err) ||
		apierrors.IsNotAcceptable(err) || apierrors.IsUnsupportedMediaType(err)
}

// answer reports whether err is a normal answer of the API server (the
// object is missing, exists, or changed meanwhile) rather than a failure.
func answer(err error) bool {
	return apierrors.IsNotFound(err) || apierrors.IsAlreadyExists(err) || apierrors.IsConflict(err)
}

// call runs f until it succeeds, gets an answer (NotFound, AlreadyExists,
// Conflict: returned for the caller to handle), fails permanently, or ctx
// ends; between failures it waits per Config.Backoff. Each attempt has its
// own timeout. Failures are counted and logged once per streak.
func (k *Kube) call(ctx context.Context, o op, f func(ctx context.Context) error) error {
	for attempt := 0; ; attempt++ {
		actx, cancel := context.WithTimeout(ctx, callTimeout)
		err := f(actx)
		cancel()
		if err == nil || answer(err) {
			k.apiOK(o)
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		k.apiFailed(o, err)
		if permanent(err) {
			return fmt.Errorf("kubernetes API: %s %s: %w", o, o.object(), err)
		}
		if err := k.wait(ctx, k.cfg.Backoff.Delay(attempt, k.rand())); err != nil {
			return err
		}
	}
}

func (o op) object() string {
	if o.ns == "" {
		return fmt.Sprintf("%q", o.name)
	}
	return fmt.Sprintf("%q in namespace %q", o.name, o.ns)
}

// wait waits d (through Config.After), or until ctx ends.
func (k *Kube) wait(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-k.cfg.After(d):
		return nil
	}
}

// streak is a run of failures of one operation.
type streak struct {
	since time.Time
	n     int
	// withdrawn: the streak is of Forbidden answers to an operation
	// that worked before; escalated: that has been logged as an error.
	withdrawn, escalated bool
}

// WithdrawnGrace is how long a permission that worked before may be
// refused before it is logged as an error. An uninstall (kubectl delete
// -k deploy/) deletes the RBAC objects before the DaemonSet, so a router
// still running meets a few refusals until its pod is stopped (its
// termination grace is 30 s); a permission taken away for good is still
// said as an error, a minute later.
const WithdrawnGrace = time.Minute

// apiFailed counts a failed call and logs it if it starts a streak of
// failures of its operation; later failures of the streak go to debug,
// but for a withdrawn permission that outlasts WithdrawnGrace.
func (k *Kube) apiFailed(o op, err error) {
	k.metrics.apiErrors.WithLabelValues(o.String()).Inc()
	forbidden := apierrors.IsForbidden(err)
	now := k.cfg.Now()
	k.mu.Lock()
	s, ok := k.streaks[o.String()]
	if !ok {
		s = &streak{since: now, withdrawn: forbidden && k.worked[o.String()]}
		k.streaks[o.String()] = s
	}
	s.n++
	escalate := ok && s.withdrawn && forbidden && !s.escalated && now.Sub(s.since) >= WithdrawnGrace
	if escalate {
		s.escalated = true
	}
	n, since := s.n, s.since
	k.mu.Unlock()
	if escalate {
		k.log.Error(forbiddenMessage(o, err)+"; it was allowed before and has been refused since "+
			since.Format(time.RFC3339)+"; retrying with backoff", "failures", n, "err", err)
		return
	}
	if ok {
		k.log.Debug("kubernetes API call failed again", "op", o.String(), "failures", n, "err", err)
		return
	}
	if s.withdrawn {
		k.log.Warn(forbiddenMessage(o, err)+"; it was allowed before: weft's RBAC was removed or changed "+
			"(expected while weft is being uninstalled, until this router stops); retrying with backoff, "+
			"an error follows if it is still refused in "+WithdrawnGrace.String(), "err", err)
		return
	}
	if forbidden {
		k.log.Error(forbiddenMessage(o, err)+"; retrying with backoff", "err", err)
		return
	}
	if permanent(err) {
		k.log.Error("kubernetes API refused the request", "op", o.String(), "object", o.object(), "err", err)
		return
	}
	k.log.Warn("kubernetes API call failed; retrying with backoff (up to "+k.cfg.Backoff.Max.String()+
		"), the router keeps running on its own state meanwhile", "op", o.String(), "err", err)
}

// apiOK ends the failure streak of o's operation, if there is one.
func (k *Kube) apiOK(o op) {
	k.mu.Lock()
	s, ok := k.streaks[o.String()]
	delete(k.streaks, o.String())
	k.worked[o.String()] = true
	k.mu.Unlock()
	if ok {
		k.log.Info("kubernetes API call works again", "op", o.String(), "failures", s.n,
			"after", k.cfg.Now().Sub(s.since).Round(time.Millisecond))
	}
}

// forbiddenRE finds the verb and resource in the API server's Forbidden
// message: `... cannot patch resource "nodes/status" in API group ...`.
var forbiddenRE = regexp.MustCompile(`cannot (\S+) resource "([^"]+)"`)

// forbiddenMessage says which permission the API server refused for a call
// of o, taking the verb and resource from the server's answer where it
// names them (and from o otherwise).
func forbiddenMessage(o op, err error) string {
	verb, resource, name, ns := o.verb, o.resource, o.name, o.ns
	var se apierrors.APIStatus
	if errors.As(err, &se) {
		st := se.Status()
		if m := forbiddenRE.FindStringSubmatch(st.Message); m != nil {
			verb, resource = m[1], m[2]
		} else if st.Details != nil && st.Details.Kind != "" {
			resource = st.Details.Kind
		}
		if st.Details != nil && st.Details.Name != "" {
			name = st.Details.Name
		}
	}
	var where []string
	for _, w := range []string{name, ns} {
		if w != "" {
			where = append(where, w)
		}
	}
	obj := ""
	if len(where) > 0 {
		obj = " (" + strings.Join(where, ", ") + ")"
	}
	return fmt.Sprintf("kubernetes API refused %s %s%s: the weft ServiceAccount needs that permission — "+
		"check deploy/weft.yaml's ClusterRole/Role", verb, resource, obj)
}
