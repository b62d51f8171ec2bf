// Package kube is weft's Kubernetes integration (weft router --kube): it
// discovers the other peers from the Node objects, keeps the map of peer
// names to node names in a ConfigMap, makes exactly one live peer reclaim
// the ranges of a peer whose Node was deleted, records the first claim of
// the ring so that nodes that start apart never seed separate rings, and
// clears the node's NetworkUnavailable condition once the router is ready.
//
// Everything it writes goes through compare-and-swap on the ConfigMap's
// resourceVersion. An API server that is down, slow or refusing is retried
// with a capped, jittered backoff; a failure streak is logged once when it
// starts and once when it ends, and nothing here ever stops the router.
//
// # The ConfigMap
//
// Namespace/ConfigMapName (kube-system/weft by default) holds JSON under
// three data keys:
//
//   - "peers": {"<peer name>": {"node": "<node name>", "nickname": "...",
//     "registered": "<time>", "reclaimer": "<peer name>", "reclaimStarted":
//     "<time>"}}. Every router registers itself at start. "reclaimer" is the
//     marker of a reclaim in progress: that peer won the compare-and-swap
//     and is taking the ranges over. "calledOff" names a reclaimer whose
//     reclaim this peer's registration called off (it came back): that
//     router withdraws the reclaim in its allocator and clears it.
//   - "reclaimed": {"<peer name>": {"node": "...", "by": "<peer name>",
//     "at": "<time>"}}: the reclaims done in the last TombstoneTTL, so that
//     if their reclaimer's node goes too, the next reclaimer also finishes
//     them (the allocator's "rmpeer the reclaimer, then the peer again").
//   - "claim": the first claim of the ring (see Claim).
//
// A key that does not decode is reported with the ConfigMap and the key in
// the error (CorruptError); weft never overwrites it, and the router keeps
// running on its own state until an operator fixes or deletes the key.
package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"

	"github.com/weft-net/weft/ipalloc"
)

// Defaults of Config.
const (
	DefaultNamespace     = "kube-system"
	DefaultConfigMapName = "weft"
	DefaultAddressType   = corev1.NodeInternalIP
	DefaultResync        = time.Minute
	DefaultTombstoneTTL  = 24 * time.Hour
)

// Config configures a Kube. Client and NodeName are required.
type Config struct {
	Client        kubernetes.Interface
	NodeName      string                 // this node (NODE_NAME from the downward API)
	Namespace     string                 // of the ConfigMap (POD_NAMESPACE); default kube-system
	ConfigMapName string                 // default "weft"
	AddressType   corev1.NodeAddressType // the Node address peers are joined at; default InternalIP

	// PeerName is this router's peer name. With it, Run registers the peer
	// in the ConfigMap and takes part in reclaims; without, Run only
	// discovers nodes.
	PeerName string
	Nickname string
	// Reclaim takes over the ranges of a peer that is gone for good (what
	// weft rmpeer does). Exactly one live router calls it per deleted peer.
	// It must be idempotent: after a restart, or when taking over from a
	// reclaimer that died, it is called again for the same peer, and it
	// should return nil when this router reclaims the peer already, or
	// the peer is unknown. An error (another peer's reclaim that is not
	// done, say) keeps the marker: it is logged and the call retried at
	// the next pass.
	// Nil: this router never reclaims.
	Reclaim func(ctx context.Context, peer string) error
	// PeerAlive, if set, is the mesh's view: a peer it sees alive is not
	// reclaimed even if its Node is gone (the Node may have been deleted
	// and re-created under a running router); the next pass tries again.
	PeerAlive func(peer string) bool
	// Withdraw calls off this router's reclaim of a peer that came back
	// (it registered again while, or after, this router reclaimed it): the
	// allocator's Withdraw. It is called until it returns nil; it should
	// return nil when there is nothing to withdraw (any more). Nil: never.
	Withdraw func(ctx context.Context, peer string) error

	// DaemonSet, if set, is weft's DaemonSet in Namespace: Run watches it,
	// and DaemonSetGone reports its deletion (an uninstall).
	DaemonSet string

	Logger     *slog.Logger
	Registerer prometheus.Registerer // nil registers nothing

	// Resync is how often the reclaim pass runs besides Node deletions
	// (it also retries what failed); default DefaultResync.
	Resync time.Duration
	// TombstoneTTL is how long a finished reclaim is remembered.
	TombstoneTTL time.Duration
	// Backoff is the schedule of retries of failed API calls, and
	// ConflictBackoff that of compare-and-swap conflicts; zero fields take
	// DefaultBackoff's and DefaultConflictBackoff's.
	Backoff, ConflictBackoff Backoff
	// Now, After and Rand are the clock, the timer and the jitter source;
	// nil: the real ones. Tests inject them.
	Now   func() time.Time
	After func(time.Duration) <-chan time.Time
	Rand  *rand.Rand
}

// Kube is the Kubernetes side of one router. New, then Run in a goroutine;
// every other method is safe to call concurrently with Run.
type Kube struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics

	changes chan struct{} // the node set changed (capacity 1: coalesced)
	kick    chan struct{} // run a reclaim pass (capacity 1)
	seen    chan struct{} // a node was added or changed (capacity 1)
	synced  chan struct{} // closed once the node informer has synced

	passMu sync.Mutex // one reclaim pass at a time

	mu         sync.Mutex
	nodes      map[string]nodeInfo // the informer's view: node name -> what weft uses of it
	streaks    map[string]*streak  // failing API operations
	worked     map[string]bool     // API operations that have succeeded since the start
	said       map[string]string   // reclaim situations logged, to log each once
	registered bool
	started    bool
	rng        *rand.Rand

	informer cache.SharedIndexInformer
	handled  cache.InformerSynced      // the node handler has seen the first list
	dsInf    cache.SharedIndexInformer // nil without Config.DaemonSet
	dsGone   atomic.Bool
}

// New validates cfg and returns a Kube that does nothing until Run.
func New(cfg Config) (*Kube, error) {
	if cfg.Client == nil {
		return nil, errors.New("kube: no Kubernetes client")
	}
	if cfg.NodeName == "" {
		return nil, errors.New("kube: this node's name is unknown: set NODE_NAME from the downward API (spec.nodeName)")
	}
	if err := validNode(cfg.NodeName); err != nil {
		return nil, fmt.Errorf("kube: invalid NODE_NAME: %w", err)
	}
	if cfg.Namespace == "" {
		cfg.Namespace = DefaultNamespace
	}
	if cfg.ConfigMapName == "" {
		cfg.ConfigMapName = DefaultConfigMapName
	}
	if cfg.AddressType == "" {
		cfg.AddressType = DefaultAddressType
	}
	if errs := validation.IsDNS1123Label(cfg.Namespace); len(errs) > 0 {
		return nil, fmt.Errorf("kube: invalid namespace %q: %s", cfg.Namespace, errs[0])
	}
	if errs := validation.IsDNS1123Subdomain(cfg.ConfigMapName); len(errs) > 0 {
		return nil, fmt.Errorf("kube: invalid ConfigMap name %q: %s", cfg.ConfigMapName, errs[0])
	}
	if _, ok := addressTypes[cfg.AddressType]; !ok {
		return nil, fmt.Errorf("kube: invalid --kube-address-type %q: use InternalIP, ExternalIP, Hostname, InternalDNS or ExternalDNS", cfg.AddressType)
	}
	if cfg.PeerName != "" {
		if err := ipalloc.ValidatePeerName(ipalloc.PeerName(cfg.PeerName)); err != nil {
			return nil, fmt.Errorf("kube: %w", err)
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Resync <= 0 {
		cfg.Resync = DefaultResync
	}
	if cfg.TombstoneTTL <= 0 {
		cfg.TombstoneTTL = DefaultTombstoneTTL
	}
	cfg.Backoff = cfg.Backoff.withDefaults(DefaultBackoff)
	cfg.ConflictBackoff = cfg.ConflictBackoff.withDefaults(DefaultConflictBackoff)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.After == nil {
		cfg.After = time.After
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))
	}
	k := &Kube{
		cfg:     cfg,
		log:     cfg.Logger,
		changes: make(chan struct{}, 1),
		kick:    make(chan struct{}, 1),
		seen:    make(chan struct{}, 1),
		synced:  make(chan struct{}),
		nodes:   map[string]nodeInfo{},
		streaks: map[string]*streak{},
		worked:  map[string]bool{},
		said:    map[string]string{},
		rng:     cfg.Rand,
	}
	m, err := newMetrics(cfg.Registerer, k)
	if err != nil {
		return nil, fmt.Errorf("kube: registering metrics: %w", err)
	}
	k.metrics = m
	if k.informer, k.handled, err = k.newNodeInformer(); err != nil {
		return nil, err
	}
	if cfg.DaemonSet != "" {
		if errs := validation.IsDNS1123Subdomain(cfg.DaemonSet); len(errs) > 0 {
			return nil, fmt.Errorf("kube: invalid DaemonSet name %q: %s", cfg.DaemonSet, errs[0])
		}
		k.dsInf = k.newDaemonSetInformer()
	}
	return k, nil
}

// rand draws the jitter of a backoff.
func (k *Kube) rand() float64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.rng.Float64()
}

// Run watches the Nodes until ctx ends: it keeps the node list that
// PeerAddrs and NodeCount read, signals Changes, registers PeerName in the
// ConfigMap once the list has synced, and runs the reclaim pass on every
// Node deletion and every Config.Resync. An unreachable API server is
// retried (the informer reconnects with backoff); Run returns only when ctx
// ends, with nil, or at once with an error if called twice.
func (k *Kube) Run(ctx context.Context) error {
	k.mu.Lock()
	if k.started {
		k.mu.Unlock()
		return errors.New("kube: Run called twice")
	}
	k.started = true
	k.mu.Unlock()

	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { k.informer.RunWithContext(ctx) })
	if k.dsInf != nil {
		wg.Go(func() { k.dsInf.RunWithContext(ctx) })
	}
	if !cache.WaitForCacheSync(ctx.Done(), k.handled) {
		return nil
	}
	k.log.Info("kubernetes: node list synced", "nodes", k.NodeCount(), "peers", len(k.PeerAddrs()), "address-type", k.cfg.AddressType)
	close(k.synced)
	k.signal(k.changes)

	if k.cfg.PeerName != "" {
		k.routineRegister(ctx)
	}
	t := time.NewTicker(k.cfg.Resync)
	defer t.Stop()
	for {
		k.reconcile(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-k.kick:
		case <-t.C:
		}
	}
}

// routineRegister registers this peer, retrying until it is done or ctx
// ends (a corrupt ConfigMap is retried at each resync, quietly). It waits
// for this node's Node object first: a router registered under a name that
// has no Node would look deleted to every other router.
func (k *Kube) routineRegister(ctx context.Context) {
	for !k.nodeKnown(k.cfg.NodeName) {
		if k.sayOnce("register", "no node") {
			k.log.Error("kubernetes: this node "+k.cfg.NodeName+" is not in the node list; check NODE_NAME "+
				"(the downward API's spec.nodeName). Not registering this peer until it appears", "node", k.cfg.NodeName)
		}
		select {
		case <-ctx.Done():
			return
		case <-k.seen:
		case <-k.cfg.After(k.cfg.Resync):
		}
	}
	for {
		err := k.RegisterPeer(ctx, k.cfg.PeerName, k.cfg.Nickname)
		if err == nil {
			// The router reads the registered peers again at once: its
			// allocator asks for no space before they name this peer.
			k.signal(k.changes)
			return
		}
		if ctx.Err() != nil {
			return
		}
		if k.sayOnce("register", err.Error()) {
			k.log.Error("kubernetes: cannot register this peer in the ConfigMap; reclaims are off, and this peer asks no other for space, until it is registered", "err", err)
		}
		if k.wait(ctx, k.cfg.Resync) != nil {
			return
		}
	}
}

// WaitSynced waits until the node list has been read once (NodeCount and
// PeerAddrs are then meaningful), or ctx ends.
func (k *Kube) WaitSynced(ctx context.Context) error {
	select {
	case <-k.synced:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("waiting for the kubernetes node list: %w", ctx.Err())
	}
}

// Server is the API server's address the client talks to (for messages).
func (k *Kube) Server() string {
	rc, ok := k.cfg.Client.CoreV1().RESTClient().(*rest.RESTClient)
	if !ok || rc == nil { // a fake client's
		return "(unknown)"
	}
	if u := rc.Get().URL(); u != nil && u.Host != "" {
		return u.Scheme + "://" + u.Host
	}
	return "(unknown)"
}

// Synced reports whether the node list has been read once.
func (k *Kube) Synced() bool {
	select {
	case <-k.synced:
		return true
	default:
		return false
	}
}

// Changes is signalled (coalesced: one pending signal at most) when the
// node list has synced, whenever a node or its address comes or goes, and
// once this peer is registered in the ConfigMap. Read PeerAddrs then.
func (k *Kube) Changes() <-chan struct{} { return k.changes }

// PeerLost runs a reclaim pass now rather than at the next Config.Resync:
// the router calls it when the mesh declares a peer unreachable or gone. A
// deleted Node whose peer still answered at the Node's deletion (the mesh
// takes seconds to notice a dead peer) is then reclaimed as soon as the
// mesh stops counting it alive, not up to a resync later. The pass checks
// everything again (the Node NotFound, Config.PeerAlive false), so an
// extra one is safe.
func (k *Kube) PeerLost() { k.signal(k.kick) }

// signal does a non-blocking send on a coalescing channel.
func (k *Kube) signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// sayOnce reports whether the situation key has not been logged with this
// text yet, and records it.
func (k *Kube) sayOnce(key, text string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	if old, ok := k.said[key]; ok && old == text {
		return false
	}
	k.said[key] = text
	return true
}

// forget drops what sayOnce recorded for key.
func (k *Kube) forget(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	delete(k.said, key)
}
