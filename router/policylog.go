package router

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/weft-net/weft/bridge"
)

// PolicySampler is an enforcer that can say which packets its policies
// dropped (bridge.PolicyLog: a rate-limited sample of the drops, through
// nflog). An enforcer without it gives counts only.
type PolicySampler interface {
	OpenSamples() (PolicySamples, error)
}

// PolicySamples reads the samples of dropped packets.
type PolicySamples interface {
	// Read waits for the next samples; after Close it returns an error.
	Read() ([]bridge.BlockedPacket, error)
	// Lost counts the samples the kernel could not queue.
	Lost() uint64
	Close() error
}

// The logs of blocked connections: a pod pair (source and destination
// address, in one direction) is logged at most once per policyLogEvery,
// and the node at most policyLogMax lines in a policyLogEvery; what is
// left out over that is counted in one line at the end of the window.
const (
	policyLogEvery = time.Minute
	policyLogMax   = 120
	// podIPIndex indexes the pod informer by pod address.
	podIPIndex = "podIP"
)

// pairKey is one pod pair in one direction.
type pairKey struct {
	src, dst netip.Addr
	egress   bool
}

// blockLogger turns samples into log lines, rate-limited.
type blockLogger struct {
	log      *slog.Logger
	now      func() time.Time
	describe func(bridge.BlockedPacket) (msg string, attrs []any)

	mu       sync.Mutex
	last     map[pairKey]time.Time // when a pair was last logged
	window   time.Time             // start of the current window
	lines    int                   // logged in the window
	over     int                   // left out over policyLogMax in it
	lostSeen uint64                // the reader's Lost as last reported
	// Totals since the start, for weft status policy.
	totalLines, totalOver uint64
	lost                  uint64 // the reader's Lost as last seen
}

func newBlockLogger(log *slog.Logger, describe func(bridge.BlockedPacket) (string, []any)) *blockLogger {
	return &blockLogger{log: log, now: time.Now, describe: describe, last: map[pairKey]time.Time{}}
}

// sample logs b unless its pair was logged within policyLogEvery or the
// window's lines are spent; lost is the reader's count of lost samples.
func (l *blockLogger) sample(b bridge.BlockedPacket, lost uint64) {
	l.mu.Lock()
	now := l.now()
	l.lost = lost
	l.roll(now, lost)
	k := pairKey{b.Src, b.Dst, b.Egress}
	if t, ok := l.last[k]; ok && now.Sub(t) < policyLogEvery {
		l.mu.Unlock()
		return
	}
	if l.lines >= policyLogMax {
		l.over++
		l.totalOver++
		l.mu.Unlock()
		return
	}
	l.lines++
	l.totalLines++
	l.last[k] = now
	l.mu.Unlock()
	msg, attrs := l.describe(b)
	l.log.Info(msg, attrs...)
}

// tick ends the window if it is over, so that what it left out is said
// without waiting for the next sample.
func (l *blockLogger) tick() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.roll(l.now(), l.lost)
}

// routineTick ends each window on time (tick) until ctx ends.
func (l *blockLogger) routineTick(ctx context.Context) {
	t := time.NewTicker(policyLogEvery / 4)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			l.tick()
		}
	}
}

// totals are the lines logged and left out, and the samples lost, since
// the start.
func (l *blockLogger) totals() (lines, over, lost uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.totalLines, l.totalOver, l.lost
}

// roll starts a new window when the current one is over: it says what the
// last one left out and forgets the pairs logged before it.
func (l *blockLogger) roll(now time.Time, lost uint64) {
	if now.Sub(l.window) < policyLogEvery {
		return
	}
	if l.over > 0 || lost > l.lostSeen {
		l.log.Warn(fmt.Sprintf("network policy: %d more blocked connections were not logged in the last minute (at most %d lines a minute), and %d samples were lost; weft_policy_blocked_total counts every dropped packet",
			l.over, policyLogMax, lost-l.lostSeen))
	}
	l.window, l.lines, l.over, l.lostSeen = now, 0, 0, lost
	for k, t := range l.last {
		if now.Sub(t) >= policyLogEvery {
			delete(l.last, k)
		}
	}
}

// runSamples logs the connections the kernel's policy rules block, until
// ctx ends. Where the enforcer cannot sample it does nothing; where the
// sampler does not open or stops reading (another process holds the
// group, a socket error), it says so once for each different reason and
// tries again with backoff: the policies are enforced all the same.
func (w *policyWatch) runSamples(ctx context.Context) error {
	s, ok := w.enf.(PolicySampler)
	if !ok {
		return nil
	}
	bl := newBlockLogger(w.log, w.describeBlocked)
	var wg sync.WaitGroup
	defer wg.Wait()
	tickCtx, stopTick := context.WithCancel(ctx)
	defer stopTick()
	wg.Go(func() { bl.routineTick(tickCtx) })
	retryMin, retryMax := w.retryMin, w.retryMax
	if retryMin <= 0 {
		retryMin = policyRetryMin
	}
	retryMax = max(retryMax, retryMin)
	backoff := retryMin
	var lostBefore uint64 // by the readers before this one
	said := ""            // the failure last logged
	for {
		r, err := s.OpenSamples()
		if err == nil {
			w.setSampling(bl, nil)
			if said != "" {
				w.log.Info("network policy: logging blocked connections again")
				said = ""
			}
			err = w.readSamples(ctx, r, bl, lostBefore)
			lostBefore += r.Lost()
			r.Close()
			if ctx.Err() != nil {
				return nil
			}
			backoff = retryMin
			err = fmt.Errorf("reading them: %w", err)
		}
		w.setSampling(bl, err)
		if err.Error() != said {
			w.log.Warn("network policy: blocked connections are not logged; retrying (weft_policy_blocked_total still counts them)", "err", err)
			said = err.Error()
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, retryMax)
	}
}

// readSamples logs what r reads until it fails or ctx ends (nil then).
func (w *policyWatch) readSamples(ctx context.Context, r PolicySamples, bl *blockLogger, lostBefore uint64) error {
	stop := context.AfterFunc(ctx, func() { r.Close() })
	defer stop()
	for {
		bs, err := r.Read()
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return err
		}
		for _, b := range bs {
			bl.sample(b, lostBefore+r.Lost())
		}
	}
}

// setSampling records the log of blocked connections for weft status
// policy: bl logging, or err why not (any more).
func (w *policyWatch) setSampling(bl *blockLogger, err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.sampler, w.samplerErr = bl, err
}

// blockedLogReport says whether blocked connections are logged.
func (w *policyWatch) blockedLogReport() BlockedLogReport {
	w.mu.Lock()
	bl, err := w.sampler, w.samplerErr
	w.mu.Unlock()
	var rep BlockedLogReport
	if err != nil {
		rep.Error = err.Error()
	}
	if bl != nil {
		rep.Lines, rep.LeftOut, rep.Lost = bl.totals()
		rep.On = err == nil
		rep.Group = bridge.PolicyLogGroup
	}
	return rep
}

// describeBlocked says what b was and what blocked it: "TCP
// 10.32.0.5:41234 -> 10.40.0.2:80 blocked by policy default/deny-all
// (ingress)", with the pods at either end by name where known.
func (w *policyWatch) describeBlocked(b bridge.BlockedPacket) (string, []any) {
	local, remote := b.Dst, b.Src
	if b.Egress {
		local, remote = b.Src, b.Dst
	}
	var pols []string
	localName := ""
	w.mu.Lock()
	if w.compiled != nil && w.compiled.rules != nil {
		if pr := w.compiled.rules.Pods[local]; pr != nil {
			d := pr.Ingress
			if b.Egress {
				d = pr.Egress
			}
			pols = d.Policies
			localName = pr.Namespace + "/" + pr.Name
		}
	}
	w.mu.Unlock()
	by := "NetworkPolicy"
	switch len(pols) {
	case 0:
	case 1:
		by = "policy " + pols[0]
	default:
		by = "policies " + strings.Join(pols, ", ")
	}
	msg := fmt.Sprintf("network policy: %s blocked by %s (%s)", b, by, b.Direction())
	remoteName := w.podNameAt(remote)
	src, dst := remoteName, localName
	if b.Egress {
		src, dst = localName, remoteName
	}
	var attrs []any
	if src != "" {
		attrs = append(attrs, "from-pod", src)
	}
	if dst != "" {
		attrs = append(attrs, "to-pod", dst)
	}
	return msg, attrs
}

// podNameAt is the namespace/name of the one running pod (not on the host
// network) with address a, "" if there is none or more than one.
func (w *policyWatch) podNameAt(a netip.Addr) string {
	objs, err := w.podInf.GetIndexer().ByIndex(podIPIndex, a.String())
	if err != nil || len(objs) != 1 {
		return ""
	}
	p, ok := objs[0].(*corev1.Pod)
	if !ok {
		return ""
	}
	return p.Namespace + "/" + p.Name
}

// podIPs indexes a pod by its addresses, if it has its own (not the host
// network's) and is not finished.
func podIPs(obj any) ([]string, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok || p.Spec.HostNetwork || p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed {
		return nil, nil
	}
	var out []string
	for _, ip := range p.Status.PodIPs {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out = append(out, a.String())
		}
	}
	return out, nil
}

// podIPIndexers is the pod informer's index by address.
var podIPIndexers = cache.Indexers{podIPIndex: podIPs}

// OpenSamples opens the reader of nflog group bridge.PolicyLogGroup in the
// router's namespace.
func (h *hostPolicy) OpenSamples() (PolicySamples, error) {
	l, err := bridge.OpenPolicyLog("")
	if err != nil {
		return nil, err
	}
	return l, nil
}

var _ PolicySampler = (*hostPolicy)(nil)
