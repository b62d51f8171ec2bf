package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	corelisters "k8s.io/client-go/listers/core/v1"
	netlisters "k8s.io/client-go/listers/networking/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/weft-net/weft/kube"
	"github.com/weft-net/weft/policy"
)

// PolicyEnforcer is the kernel's side of NetworkPolicy: the rules of this
// node's pods in nftables (bridge.PolicyTable). Only the router's policy
// loop calls Sync; Blocked is called by a metrics scrape, never at the
// same time as Sync (policyWatch serializes the calls).
type PolicyEnforcer interface {
	// Sync makes the kernel enforce exactly nr, changing only what
	// differs from what it enforces now (also what a previous run left).
	Sync(nr *policy.NodeRules) error
	// Blocked reads the counters of packets the policies dropped.
	Blocked() (ingress, egress uint64, err error)
	// Teardown removes every policy rule (--network-policy=false).
	Teardown() error
}

// Policy retries: a failed Sync is tried again after policyRetryMin,
// doubling up to policyRetryMax. Every policyResync the rules are
// compiled and synced again even without a change (a table changed by
// hand comes back).
const (
	policyRetryMin = time.Second
	policyRetryMax = 30 * time.Second
	policyResync   = time.Minute
	// admitWait bounds how long a pod's ADD waits for its rules.
	admitWait = 20 * time.Second
)

// pendingPod is a pod whose ADD this router answered (so it has its
// address) before the API server shows the address in its status.
type pendingPod struct {
	pod policy.Pod
}

// policyWatch watches the Pods, Namespaces and NetworkPolicies (one
// shared informer factory), compiles the rules of this node's pods on
// every change that matters and has the enforcer apply them. Changes that
// come while a compile and Sync run coalesce into one more (kick has room
// for one signal): a burst costs at most two syncs, and no timer delays
// the first. A pod's ADD waits for a Sync that includes the pod (admit).
type policyWatch struct {
	log    *slog.Logger
	node   string
	client kubernetes.Interface
	enf    PolicyEnforcer
	enfMu  sync.Mutex // one call into the enforcer at a time

	factory    informers.SharedInformerFactory
	podInf     cache.SharedIndexInformer
	nsInf      cache.SharedIndexInformer
	polInf     cache.SharedIndexInformer
	pods       corelisters.PodLister
	namespaces corelisters.NamespaceLister
	policies   netlisters.NetworkPolicyLister

	kick      chan struct{} // compile and sync (capacity 1)
	synced    chan struct{} // closed once the three lists are read
	retryMin  time.Duration
	retryMax  time.Duration
	syncTotal *prometheus.CounterVec
	syncTime  prometheus.Histogram

	mu          sync.Mutex
	pending     map[string]pendingPod // namespace/name -> pod
	wanted      uint64                // generation asked for
	applied     uint64                // generation applied
	appliedCh   chan struct{}         // closed (and replaced) when applied or lastErr changes
	lastErr     error                 // of the last Sync; nil after a success
	failures    int                   // Syncs failed in a row
	total       [2]uint64             // Syncs ok, failed
	compiled    *policyState          // what the last Sync was given
	appliedAt   time.Time             // of the last successful Sync
	waiting     int                   // ADDs waiting for their rules
	listErrs    map[string]error      // resource -> the last error listing or watching it
	withdrawn   map[string]*refusal   // resource -> its run of Forbidden lists after it was listed once
	now         func() time.Time      // the clock of withdrawn (a test sets it)
	problems    map[string]bool       // Compile's problems logged already
	blockedLast [2]uint64             // the enforcer's counters as last read
	sampler     *blockLogger          // the log of blocked connections, once it runs
	samplerErr  error                 // why it does not (any more)
}

// policyState is what one Sync was given, for weft status policy.
type policyState struct {
	at       time.Time
	rules    *policy.NodeRules
	policies []networkingv1.NetworkPolicy
	pods     []policy.Pod // this node's
	counts   worldCounts
}

// worldCounts says how many objects a World was built from.
type worldCounts struct {
	Pods, LocalPods, HostNetwork, NoAddress, Terminated, Namespaces, Policies int
}

// newPolicyWatch builds the informers (they start in Run) and registers
// the metrics.
func newPolicyWatch(client kubernetes.Interface, node string, enf PolicyEnforcer, log *slog.Logger, reg prometheus.Registerer, retryMin time.Duration) (*policyWatch, error) {
	if retryMin <= 0 {
		retryMin = policyRetryMin
	}
	w := &policyWatch{
		log: log, node: node, client: client, enf: enf,
		kick:      make(chan struct{}, 1),
		synced:    make(chan struct{}),
		retryMin:  retryMin,
		retryMax:  max(policyRetryMax, retryMin),
		pending:   map[string]pendingPod{},
		appliedCh: make(chan struct{}),
		listErrs:  map[string]error{},
		withdrawn: map[string]*refusal{},
		now:       time.Now,
		problems:  map[string]bool{},
		syncTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_policy_sync_total",
			Help: "Applications of this node's NetworkPolicy rules to the kernel, by result (ok, error).",
		}, []string{"result"}),
		syncTime: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "weft_policy_sync_duration_seconds",
			Help:    "Time to compile this node's NetworkPolicy rules and apply them to the kernel.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
	}
	w.syncTotal.WithLabelValues("ok")
	w.syncTotal.WithLabelValues("error")
	if reg != nil {
		if err := errors.Join(reg.Register(w.syncTotal), reg.Register(w.syncTime), reg.Register(&blockedCollector{w: w})); err != nil {
			return nil, fmt.Errorf("registering the network policy metrics: %w", err)
		}
	}
	// What weft does not read is dropped from the cache: the managed
	// fields and the annotations (a last-applied-configuration may be
	// large) of every object.
	trim := func(obj any) (any, error) {
		if m, err := metaOf(obj); err == nil {
			m.SetManagedFields(nil)
			m.SetAnnotations(nil)
		}
		return obj, nil
	}
	w.factory = informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTransform(trim))
	w.podInf = w.factory.Core().V1().Pods().Informer()
	if err := w.podInf.AddIndexers(podIPIndexers); err != nil {
		return nil, err
	}
	w.nsInf = w.factory.Core().V1().Namespaces().Informer()
	w.polInf = w.factory.Networking().V1().NetworkPolicies().Informer()
	w.pods = w.factory.Core().V1().Pods().Lister()
	w.namespaces = w.factory.Core().V1().Namespaces().Lister()
	w.policies = w.factory.Networking().V1().NetworkPolicies().Lister()
	for res, inf := range map[string]cache.SharedIndexInformer{"pods": w.podInf, "namespaces": w.nsInf, "networkpolicies.networking.k8s.io": w.polInf} {
		if err := inf.SetWatchErrorHandlerWithContext(w.watchError(res, inf.HasSynced)); err != nil {
			return nil, err
		}
		var h cache.ResourceEventHandler = cache.ResourceEventHandlerFuncs{
			AddFunc:    func(any) { w.signal() },
			UpdateFunc: func(any, any) { w.signal() },
			DeleteFunc: func(any) { w.signal() },
		}
		if inf == w.podInf {
			h = cache.ResourceEventHandlerFuncs{
				AddFunc: func(any) { w.signal() },
				UpdateFunc: func(old, cur any) {
					if podChanged(old, cur) {
						w.signal()
					}
				},
				DeleteFunc: func(obj any) { w.podDeleted(obj); w.signal() },
			}
		}
		if _, err := inf.AddEventHandler(h); err != nil {
			return nil, err
		}
	}
	return w, nil
}

func metaOf(obj any) (metav1.Object, error) {
	if m, ok := obj.(metav1.Object); ok {
		return m, nil
	}
	return nil, errors.New("not an object")
}

// refusal is a run of Forbidden answers to the list or watch of a
// resource that was listed before: since its first, last the latest;
// escalated once it has been logged as an error.
type refusal struct {
	since, last time.Time
	escalated   bool
}

// watchError records (and logs) why listing or watching a resource fails:
// a forbidden list names the permission the ServiceAccount lacks. A
// permission refused after the resource was listed (worked) is one that
// was taken away: an uninstall (kubectl delete -k deploy/) deletes the
// RBAC objects before the DaemonSet, so a router still running meets such
// refusals until its pod stops. That is a warning, and an error only once
// it has lasted kube.WithdrawnGrace, as for the router's other API calls
// (kube.Kube). A permission that never worked is an error at once.
func (w *policyWatch) watchError(resource string, worked func() bool) cache.WatchErrorHandlerWithContext {
	return func(ctx context.Context, _ *cache.Reflector, err error) {
		if ctx.Err() != nil {
			return
		}
		forbidden := apierrors.IsForbidden(err)
		if forbidden {
			err = fmt.Errorf("the API server refuses to list or watch %s: %w; the router's ServiceAccount needs get, list and watch on %s "+
				"(the ClusterRole weft in deploy/weft.yaml grants them)", resource, err, resource)
		} else {
			err = fmt.Errorf("listing or watching %s: %w", resource, err)
		}
		now := w.now()
		w.mu.Lock()
		old := w.listErrs[resource]
		w.listErrs[resource] = err
		r := w.withdrawn[resource]
		if r != nil && (!forbidden || now.Sub(r.last) > kube.WithdrawnGrace) {
			r = nil // the run ended: another error, or none for longer than the grace
			delete(w.withdrawn, resource)
		}
		start := r == nil && forbidden && worked()
		if start {
			r = &refusal{since: now}
			w.withdrawn[resource] = r
		}
		escalate := false
		if r != nil {
			r.last = now
			escalate = !r.escalated && now.Sub(r.since) >= kube.WithdrawnGrace
			r.escalated = r.escalated || escalate
		}
		w.mu.Unlock()
		switch {
		case start:
			w.log.Warn("network policy: "+err.Error()+"; it was allowed before: weft's RBAC was removed or changed "+
				"(expected while weft is being uninstalled, until this router stops); retrying, an error follows if it is still refused in "+
				kube.WithdrawnGrace.String(), "resource", resource)
		case escalate:
			w.log.Error("network policy: "+err.Error()+"; it was allowed before and has been refused since "+
				r.since.Format(time.RFC3339)+"; retrying", "resource", resource)
		case r != nil:
			w.log.Debug("network policy: still refused", "resource", resource, "err", err)
		case old == nil || old.Error() != err.Error():
			w.log.Error("network policy: "+err.Error()+"; retrying", "resource", resource)
		}
	}
}

// podChanged reports whether an update changes what the policies see of
// a pod (a pod's status changes often: readiness, restarts).
func podChanged(old, cur any) bool {
	a, ok1 := old.(*corev1.Pod)
	b, ok2 := cur.(*corev1.Pod)
	if !ok1 || !ok2 {
		return true
	}
	pa, oka, _ := podOf(a)
	pb, okb, _ := podOf(b)
	if oka != okb {
		return true
	}
	return pa.Node != pb.Node || pa.IP != pb.IP || !labels.Equals(pa.Labels, pb.Labels) || !slices.Equal(pa.Ports, pb.Ports)
}

// podDeleted drops the pending entry of a deleted pod.
func (w *policyWatch) podDeleted(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return
	}
	w.mu.Lock()
	delete(w.pending, p.Namespace+"/"+p.Name)
	w.mu.Unlock()
}

func (w *policyWatch) signal() {
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Why a pod is left out of the World: such a pod is matched by no
// selector and enforces nothing.
const (
	skipHostNetwork = "hostNetwork" // it has the node's address: its traffic is the node's
	skipNoAddress   = "no address"  // not started yet, or its sandbox is gone
	skipTerminated  = "terminated"  // Succeeded or Failed: its address is released and may be another pod's already
)

// podOf is what the policies see of p: its IPv4 address from
// status.podIPs, its node from spec.nodeName and its named container
// ports; ok false (with why) for a pod left out.
func podOf(p *corev1.Pod) (_ policy.Pod, ok bool, why string) {
	x := policy.Pod{Namespace: p.Namespace, Name: p.Name, Labels: p.Labels, Node: p.Spec.NodeName, Ports: podPorts(p)}
	switch {
	case p.Spec.HostNetwork:
		return x, false, skipHostNetwork
	case p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed:
		return x, false, skipTerminated
	}
	ips := p.Status.PodIPs
	if len(ips) == 0 && p.Status.PodIP != "" {
		ips = []corev1.PodIP{{IP: p.Status.PodIP}}
	}
	for _, ip := range ips {
		if a, err := netip.ParseAddr(ip.IP); err == nil && a.Is4() {
			x.IP = a
			return x, true, ""
		}
	}
	return x, false, skipNoAddress
}

// podPorts are p's named container ports (those of its sidecars, the
// restartable init containers, too): what a named port in a policy
// resolves against.
func podPorts(p *corev1.Pod) []policy.Port {
	var out []policy.Port
	add := func(cs []corev1.Container) {
		for _, c := range cs {
			for _, cp := range c.Ports {
				if cp.Name == "" || cp.ContainerPort < 1 || cp.ContainerPort > 65535 {
					continue
				}
				proto := cp.Protocol
				if proto == "" {
					proto = corev1.ProtocolTCP
				}
				out = append(out, policy.Port{Name: cp.Name, Protocol: proto, Number: uint16(cp.ContainerPort)})
			}
		}
	}
	add(p.Spec.Containers)
	var sidecars []corev1.Container
	for _, c := range p.Spec.InitContainers {
		if c.RestartPolicy != nil && *c.RestartPolicy == corev1.ContainerRestartPolicyAlways {
			sidecars = append(sidecars, c)
		}
	}
	add(sidecars)
	return out
}

// buildWorld makes the World from the informers' caches and the pending
// pods. A pending pod wins over any pod the cache shows at its address
// (the router has just allocated it: the other is gone); of two cached
// pods at one address the newer wins. It prunes the pending pods the
// cache shows at their address now.
func buildWorld(pods []*corev1.Pod, nss []*corev1.Namespace, pols []*networkingv1.NetworkPolicy, pending map[string]pendingPod, node string) (*policy.World, worldCounts) {
	var c worldCounts
	w := &policy.World{}
	byIP := map[netip.Addr]int{} // index in w.Pods
	created := map[netip.Addr]time.Time{}
	pendingIPs := map[netip.Addr]bool{}
	for _, pp := range pending {
		pendingIPs[pp.pod.IP] = true
	}
	for _, p := range pods {
		key := p.Namespace + "/" + p.Name
		x, ok, why := podOf(p)
		if pp, isPending := pending[key]; isPending && ok && x.IP == pp.pod.IP {
			delete(pending, key) // the API shows it now
			delete(pendingIPs, x.IP)
		}
		if !ok {
			switch why {
			case skipHostNetwork:
				c.HostNetwork++
			case skipTerminated:
				c.Terminated++
			default:
				c.NoAddress++
			}
			continue
		}
		if _, isPending := pending[key]; isPending || pendingIPs[x.IP] {
			continue // the pending entry stands for it, or has its address
		}
		if i, dup := byIP[x.IP]; dup {
			if !p.CreationTimestamp.Time.After(created[x.IP]) {
				continue
			}
			w.Pods[i] = x
		} else {
			byIP[x.IP] = len(w.Pods)
			w.Pods = append(w.Pods, x)
		}
		created[x.IP] = p.CreationTimestamp.Time
	}
	for _, pp := range pending {
		w.Pods = append(w.Pods, pp.pod)
	}
	for _, ns := range nss {
		w.Namespaces = append(w.Namespaces, policy.Namespace{Name: ns.Name, Labels: ns.Labels})
	}
	for _, p := range pols {
		w.Policies = append(w.Policies, *p)
	}
	sortWorld(w)
	c.Pods, c.Namespaces, c.Policies = len(w.Pods), len(w.Namespaces), len(w.Policies)
	for _, x := range w.Pods {
		if x.Node == node {
			c.LocalPods++
		}
	}
	return w, c
}

// sortWorld orders a World by namespace and name, so that the same
// objects always compile to the same rules in the same order.
func sortWorld(w *policy.World) {
	slices.SortFunc(w.Pods, func(a, b policy.Pod) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	})
	slices.SortFunc(w.Namespaces, func(a, b policy.Namespace) int { return strings.Compare(a.Name, b.Name) })
	slices.SortFunc(w.Policies, func(a, b networkingv1.NetworkPolicy) int {
		return strings.Compare(a.Namespace+"/"+a.Name, b.Namespace+"/"+b.Name)
	})
}

// Run starts the informers, waits for the three lists, then compiles and
// syncs on every change (and every policyResync), retrying a failed Sync
// with backoff, until ctx ends. Before the lists are read nothing is
// synced: the rules a previous run left in the kernel stay in force.
func (w *policyWatch) Run(ctx context.Context) error {
	w.factory.Start(ctx.Done())
	defer w.factory.Shutdown()
	if !cache.WaitForCacheSync(ctx.Done(), w.podInf.HasSynced, w.nsInf.HasSynced, w.polInf.HasSynced) {
		return nil
	}
	w.mu.Lock()
	clear(w.listErrs)
	w.mu.Unlock()
	close(w.synced)
	w.log.Info("network policy: watching pods, namespaces and NetworkPolicies", "node", w.node)

	resync := time.NewTicker(policyResync)
	defer resync.Stop()
	var retry <-chan time.Time
	backoff := w.retryMin
	for {
		if err := w.syncOnce(); err != nil {
			retry = time.After(backoff)
			backoff = min(2*backoff, w.retryMax)
		} else {
			retry, backoff = nil, w.retryMin
		}
		select {
		case <-ctx.Done():
			return nil
		case <-w.kick:
		case <-retry:
		case <-resync.C:
		}
	}
}

// syncOnce compiles the rules from the caches as they are now and syncs
// them: every generation asked for until now is then applied.
func (w *policyWatch) syncOnce() error {
	start := time.Now()
	pods, err1 := w.pods.List(labels.Everything())
	nss, err2 := w.namespaces.List(labels.Everything())
	pols, err3 := w.policies.List(labels.Everything())
	if err := errors.Join(err1, err2, err3); err != nil {
		return w.record(start, nil, fmt.Errorf("reading the informers' caches: %w", err), 0)
	}
	w.mu.Lock()
	gen := w.wanted
	world, counts := buildWorld(pods, nss, pols, w.pending, w.node)
	w.mu.Unlock()
	nr := policy.Compile(world, w.node)
	for _, p := range nr.Problems {
		w.mu.Lock()
		said := w.problems[p]
		w.problems[p] = true
		w.mu.Unlock()
		if !said {
			w.log.Warn("network policy: " + p)
		}
	}
	w.enfMu.Lock()
	err := w.enf.Sync(nr)
	w.enfMu.Unlock()
	st := &policyState{at: time.Now(), rules: nr, policies: world.Policies, counts: counts}
	for _, x := range world.Pods {
		if x.Node == w.node {
			st.pods = append(st.pods, x)
		}
	}
	return w.record(start, st, err, gen)
}

// record records the outcome of one sync: on success st is in force and
// generation gen applied.
func (w *policyWatch) record(start time.Time, st *policyState, err error, gen uint64) error {
	w.syncTime.Observe(time.Since(start).Seconds())
	w.mu.Lock()
	defer w.mu.Unlock()
	failures := w.failures
	if st != nil {
		w.compiled = st
	}
	if err != nil {
		w.total[1]++
		w.syncTotal.WithLabelValues("error").Inc()
		w.failures++
		switch {
		case w.lastErr != nil && w.lastErr.Error() == err.Error():
		default:
			w.log.Error("network policy: applying this node's rules failed; the rules in force stay as they were, retrying", "err", err, "failures", w.failures)
		}
	} else {
		w.total[0]++
		w.syncTotal.WithLabelValues("ok").Inc()
		w.failures = 0
		w.appliedAt = st.at
		w.applied = max(w.applied, gen)
		if failures > 0 {
			w.log.Info("network policy: this node's rules are applied again", "after-failures", failures)
		}
	}
	w.lastErr = err
	close(w.appliedCh)
	w.appliedCh = make(chan struct{})
	return err
}

// admit is a pod's ADD: it returns once the rules that select the pod,
// with its new address ip, are applied. A pod that no NetworkPolicy of
// its namespace selects is isolated by nothing and is not waited for;
// its address still goes into the next sync (as a peer of other pods'
// rules). The informers' lists are waited for first: until they are
// read, nothing is known of the namespace's policies. The pod's labels
// come from the cache, or the API server if the cache has not seen the
// pod yet.
func (w *policyWatch) admit(ctx context.Context, namespace, name string, ip netip.Addr) error {
	if namespace == "" || name == "" {
		return nil // not a Kubernetes pod: no policy can select it
	}
	select {
	case <-w.synced:
	case <-ctx.Done():
		return fmt.Errorf("network policy: the pod, namespace and NetworkPolicy lists are not read yet, so the policies of pod %s/%s are unknown: %s", namespace, name, w.notSyncedReason(ctx.Err()))
	}
	pols, err := w.policies.NetworkPolicies(namespace).List(labels.Everything())
	if err != nil {
		return fmt.Errorf("network policy: reading the NetworkPolicies of namespace %s: %w", namespace, err)
	}
	pod, err := w.pods.Pods(namespace).Get(name)
	if apierrors.IsNotFound(err) && len(pols) > 0 {
		pod, err = w.client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
	}
	if err != nil && (len(pols) > 0 || !apierrors.IsNotFound(err)) {
		return fmt.Errorf("network policy: reading pod %s/%s for the policies that select it: %w", namespace, name, err)
	}
	var x policy.Pod
	if pod != nil {
		x, _, _ = podOf(pod)
		if pod.Spec.HostNetwork {
			return nil
		}
	} else {
		x = policy.Pod{Namespace: namespace, Name: name}
	}
	x.IP, x.Node = ip, w.node
	selected := slices.ContainsFunc(pols, func(p *networkingv1.NetworkPolicy) bool {
		sel, err := metav1.LabelSelectorAsSelector(&p.Spec.PodSelector)
		return err == nil && sel.Matches(labels.Set(x.Labels))
	})
	w.mu.Lock()
	w.wanted++
	gen := w.wanted
	w.pending[namespace+"/"+name] = pendingPod{pod: x}
	w.mu.Unlock()
	w.signal()
	if !selected {
		return nil
	}
	w.mu.Lock()
	w.waiting++
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.waiting--
		w.mu.Unlock()
	}()
	for {
		w.mu.Lock()
		applied, changed, lastErr := w.applied, w.appliedCh, w.lastErr
		w.mu.Unlock()
		if applied >= gen {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			why := ctx.Err().Error()
			if lastErr != nil {
				why = lastErr.Error()
			}
			return fmt.Errorf("network policy: the rules of pod %s/%s (%s) are not applied yet: %s", namespace, name, ip, why)
		}
	}
}

// notSyncedReason says why the lists are not read yet.
func (w *policyWatch) notSyncedReason(ctxErr error) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var errs []string
	for _, res := range slices.Sorted(maps.Keys(w.listErrs)) {
		errs = append(errs, w.listErrs[res].Error())
	}
	if len(errs) == 0 {
		return ctxErr.Error()
	}
	return strings.Join(errs, "; ")
}

// forget drops the pending pod at ip (its address was released), and
// has the rules compiled again without it.
func (w *policyWatch) forget(ip netip.Addr) {
	w.mu.Lock()
	for k, pp := range w.pending {
		if pp.pod.IP == ip {
			delete(w.pending, k)
		}
	}
	w.mu.Unlock()
	w.signal()
}

// blocked reads the enforcer's counters; on an error, the last ones.
func (w *policyWatch) blocked() (ingress, egress uint64) {
	w.enfMu.Lock()
	in, eg, err := w.enf.Blocked()
	w.enfMu.Unlock()
	w.mu.Lock()
	defer w.mu.Unlock()
	if err != nil {
		w.log.Debug("network policy: reading the blocked counters", "err", err)
		return w.blockedLast[0], w.blockedLast[1]
	}
	w.blockedLast = [2]uint64{in, eg}
	return in, eg
}

// blockedCollector is weft_policy_blocked_total{direction}, read from the
// enforcer's counters at each scrape (one read for both directions).
type blockedCollector struct{ w *policyWatch }

var blockedDesc = prometheus.NewDesc("weft_policy_blocked_total",
	"Packets dropped by NetworkPolicy on this node, by direction (ingress: into a pod of this node; egress: out of one).", []string{"direction"}, nil)

func (c *blockedCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- blockedDesc
	ch <- blockedLogDesc
}

func (c *blockedCollector) Collect(ch chan<- prometheus.Metric) {
	in, eg := c.w.blocked()
	ch <- prometheus.MustNewConstMetric(blockedDesc, prometheus.CounterValue, float64(in), "ingress")
	ch <- prometheus.MustNewConstMetric(blockedDesc, prometheus.CounterValue, float64(eg), "egress")
	b := c.w.blockedLogReport()
	ch <- prometheus.MustNewConstMetric(blockedLogDesc, prometheus.CounterValue, float64(b.Lines), "logged")
	ch <- prometheus.MustNewConstMetric(blockedLogDesc, prometheus.CounterValue, float64(b.LeftOut), "left_out")
	ch <- prometheus.MustNewConstMetric(blockedLogDesc, prometheus.CounterValue, float64(b.Lost), "lost")
}

// blockedLogDesc is weft_policy_blocked_log_total{result}: what became of
// the samples of dropped packets (docs/networkpolicy.md).
var blockedLogDesc = prometheus.NewDesc("weft_policy_blocked_log_total",
	"Log lines of blocked connections: logged; left out over the per-minute limit; samples lost before the router read them (the kernel's socket buffer full).", []string{"result"}, nil)

// removePolicyRules is the start of a router without --network-policy:
// rules that a run with it left in the kernel would go on enforcing
// policies nobody watches any more, so they go.
func (r *Router) removePolicyRules(context.Context) error {
	enf, err := r.kernel.PolicyTable()
	if err == nil {
		err = enf.Teardown()
	}
	if err != nil {
		r.log.Warn("network policy is off, but removing the rules a previous run may have left failed", "err", err)
	}
	return nil
}
