package router

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/weft-net/weft/ipalloc"
	"github.com/weft-net/weft/kube"
	"github.com/weft-net/weft/mesh"
)

// kubeMembersEvery is how many rounds of routineKube (5 s each) pass
// between two reads of the peers registered in the ConfigMap.
const kubeMembersEvery = 6

// newKube makes the client of the API server (weft router --kube); Node.Run
// runs its watch of the Nodes. The node list and the ConfigMap are read by
// kubeInit, routineKube and the reclaim pass.
func (r *Router) newKube() error {
	client := r.seams.kubeClient
	if client == nil {
		c, err := kube.NewClient(r.cfg.Kubeconfig, Version)
		if err != nil {
			return fmt.Errorf("--kube: %w", err)
		}
		client = c
	}
	k, err := kube.New(kube.Config{
		Client:      client,
		NodeName:    r.cfg.NodeName,
		Namespace:   r.cfg.KubeNamespace,
		DaemonSet:   r.cfg.KubeDaemonSet,
		AddressType: corev1.NodeAddressType(r.cfg.KubeAddressType),
		PeerName:    r.name,
		Nickname:    r.cfg.Nickname,
		Reclaim:     r.kubeReclaim,
		Withdraw:    r.kubeWithdraw,
		PeerAlive:   r.peerMaybeAlive,
		Logger:      r.log,
		Registerer:  r.metrics.reg,
		Resync:      r.seams.kubeResync,
	})
	if err != nil {
		return fmt.Errorf("--kube: %w", err)
	}
	r.kube = k
	if r.cfg.Policy {
		enf, err := r.kernel.PolicyTable()
		if err != nil {
			return fmt.Errorf("--network-policy: %w", err)
		}
		if r.policy, err = newPolicyWatch(client, r.cfg.NodeName, enf, r.log, r.metrics.reg, r.seams.policyRetry); err != nil {
			return fmt.Errorf("--network-policy: %w", err)
		}
	}
	r.log.Info("kubernetes: watching nodes", "node", r.cfg.NodeName, "configmap", r.cfg.KubeNamespace+"/"+kube.DefaultConfigMapName, "address-type", r.cfg.KubeAddressType)
	return nil
}

// kubeInit decides how a peer whose state holds no ring makes the first
// claim, from what the cluster has recorded: if a first claim is recorded
// in the ConfigMap, the ring exists somewhere and this peer must never
// claim on its own; it joins and asks for space (observer). If none is
// recorded, it takes part in the consensus among all the cluster's nodes
// (quorum: more than half of them), so that nodes that start alone or in a
// partition cannot seed a ring of their own. An explicit --ipalloc-init
// other than plain "consensus" is the operator's and is kept. Without an
// answer from the API server it cannot decide safely, so it waits (logging
// why) until it gets one or ctx ends.
func (r *Router) kubeInit(ctx context.Context, init ipalloc.Init) (ipalloc.Init, error) {
	if r.cfg.Init.Kind != "consensus" || r.cfg.Init.Quorum != 0 {
		return init, nil
	}
	start := time.Now()
	var lastSaid time.Time // when the wait was last logged
	var interim *http.Server
	reason := new(atomic.Pointer[string]) // what /readyz says meanwhile
	defer func() {
		if interim != nil {
			interim.Close()
		}
		if !lastSaid.IsZero() && ctx.Err() == nil {
			r.log.Info("kubernetes: the API server answers; going on with the start", "waited", time.Since(start).Round(time.Millisecond))
		}
	}()
	for {
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		nodes, err := r.kube.CountNodes(wctx)
		var claim kube.Claim
		var recorded bool
		if err == nil {
			claim, recorded, err = r.kube.ClaimRecord(wctx)
		}
		cancel()
		switch {
		case ctx.Err() != nil:
			return init, ctx.Err()
		case err == nil && recorded:
			if claim.Universe != r.cfg.Universe {
				return init, fmt.Errorf("the cluster's ring covers %s (first claim %s, recorded in ConfigMap %s/%s), but --ipalloc-range is %s: start with --ipalloc-range=%s",
					claim.Universe, claim.Seed, r.cfg.KubeNamespace, kube.DefaultConfigMapName, r.cfg.Universe, claim.Universe)
			}
			r.log.Info("kubernetes: the ring was claimed already; this peer joins it and asks for space", "claim", claim.String())
			return ipalloc.Init{Observer: true}, nil
		case err == nil:
			seen := max(nodes, 1)
			rctx, rcancel := context.WithTimeout(ctx, 5*time.Second)
			n, rerr := r.kube.RecordConsensus(rctx, seen) // one N for every router
			rcancel()
			if rerr == nil {
				if n != seen {
					r.log.Info(fmt.Sprintf("kubernetes: this router sees %d nodes, but the consensus size recorded by the first router is %d: using %d", seen, n, n))
				}
				r.log.Info(fmt.Sprintf("kubernetes: no first claim recorded; consensus among the cluster's %d nodes (quorum %d)", n, n/2+1))
				return ipalloc.Init{Consensus: n}, nil
			}
			err = rerr
		}
		why := fmt.Sprintf("waiting for the Kubernetes API (%s) to decide the first claim: %v", r.kube.Server(), err)
		reason.Store(&why)
		if interim == nil {
			interim = r.serveWaiting(func() string { return *reason.Load() })
		}
		// Said at once, then at most every kubeWaitLogEvery: the API
		// server may take minutes (kube-proxy not running yet, say).
		if lastSaid.IsZero() || time.Since(lastSaid) >= kubeWaitLogEvery {
			lastSaid = time.Now()
			r.log.Warn("kubernetes: cannot read the node list and the ConfigMap; a peer without state must not claim addresses on its own, so it waits for the API server "+
				"(alive, not ready; is the API server's address reachable from this node? the kubeconfig's server, or KUBERNETES_SERVICE_HOST through kube-proxy)",
				"api-server", r.kube.Server(), "waited", time.Since(start).Round(time.Second), "err", err)
		}
		select {
		case <-ctx.Done():
			return init, ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
}

// kubeWaitLogEvery is how often kubeInit repeats that it waits for the API
// server.
const kubeWaitLogEvery = time.Minute

// serveWaiting answers the status address while the router cannot start
// yet: /healthz says it is alive (so a liveness probe does not restart a
// router that is only waiting), everything else says what it waits for
// (reason, read at each request). Nil if the address cannot be served (the
// real server reports that later).
func (r *Router) serveWaiting(reason func() string) *http.Server {
	ln, err := net.Listen("tcp", r.cfg.HTTPAddr)
	if err != nil {
		return nil
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not ready: "+reason(), http.StatusServiceUnavailable)
	})
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go srv.Serve(ln)
	return srv
}

// kubeReclaim takes over the ranges of a peer whose Node was deleted; the
// kube package calls it on exactly one live router per peer. The peers
// registered in the ConfigMap join the allocator's barrier first. When
// another peer's reclaim of it runs in the allocator already, that is done
// only once nothing of the peer's is left in this ring: until then the
// error keeps the ConfigMap's marker, and the call is retried at every
// pass, so that once the other reclaimer is removed too (its Node deleted),
// this router takes the job over.
func (r *Router) kubeReclaim(ctx context.Context, peer string) error {
	name := ipalloc.PeerName(peer)
	if err := ipalloc.ValidatePeerName(name); err != nil {
		return err
	}
	if r.alivePeers()[name] {
		return fmt.Errorf("peer %s is alive: its ranges stay with it", peer)
	}
	if _, err := r.kubeMembers(ctx); err != nil {
		return fmt.Errorf("reading the peers registered in the ConfigMap for the barrier: %w", err)
	}
	return reclaimOutcome(r.ipam, name, r.ipam.PeerGone(name), r.log)
}

// ipamReclaimer is what reclaimOutcome needs of the allocator.
type ipamReclaimer interface {
	Ring() *ipalloc.Ring
}

// reclaimOutcome turns the allocator's answer to PeerGone into the kube
// package's: nil when the reclaim is this peer's (started or resumed), or
// when another peer reclaims the peer and nothing of it is left in this
// ring; otherwise the error, and the kube package retries.
func reclaimOutcome(ipam ipamReclaimer, name ipalloc.PeerName, err error, log *slog.Logger) error {
	var other *ipalloc.ReclaimingError
	switch {
	case err == nil:
		log.Info(fmt.Sprintf("kubernetes: node of peer %s deleted: reclaiming its ranges", name))
		return nil
	case errors.As(err, &other) && !slices.Contains(ipam.Ring().Peers(), name):
		return nil // the other reclaimer took its ranges over
	case errors.As(err, &other):
		return fmt.Errorf("%w; %s still owns ranges in this peer's ring: waiting for %s to finish, or to be removed too", err, name, other.By)
	}
	return err
}

// kubeWithdraw calls off this router's reclaim of a peer that came back
// (it registered again in the ConfigMap). Too late, once the reclaim took
// its ranges over: the peer allocates nothing, and must join again under a
// new name (weft reset), which the log says.
func (r *Router) kubeWithdraw(_ context.Context, peer string) error {
	name := ipalloc.PeerName(peer)
	if err := ipalloc.ValidatePeerName(name); err != nil {
		return err
	}
	return withdrawOutcome(r.ipam, name, r.log)
}

// ipamWithdrawer is what withdrawOutcome needs of the allocator.
type ipamWithdrawer interface {
	Reclaiming(ipalloc.PeerName) (reclaiming, done bool)
	Withdraw(ipalloc.PeerName) error
}

func withdrawOutcome(ipam ipamWithdrawer, name ipalloc.PeerName, log *slog.Logger) error {
	reclaiming, _ := ipam.Reclaiming(name)
	err := ipam.Withdraw(name)
	var other *ipalloc.ReclaimingError
	switch {
	case errors.Is(err, ipalloc.ErrReclaimDone):
		log.Error(fmt.Sprintf("kubernetes: peer %s came back, but this peer has taken over its ranges already: it allocates nothing; "+
			"run weft reset --force on its node and restart the router there to join under a new name", name))
		return nil
	case errors.As(err, &other):
		return nil // not this peer's reclaim
	case err != nil:
		return err
	case reclaiming:
		log.Info(fmt.Sprintf("kubernetes: peer %s came back before its ranges were taken over: its reclaim is withdrawn", name))
	}
	return nil
}

// kubeMembers adds the peers registered in the ConfigMap to the
// allocator's members: every reclaim waits for them too, and so does the
// hold of a peer that started without state (it does not end before they
// have been read once: ipalloc's SetExternalMembers). It reports whether
// they name this peer: the allocator asks for no space before they do.
func (r *Router) kubeMembers(ctx context.Context) (self bool, err error) {
	peers, err := r.kube.Peers(ctx)
	if err != nil {
		return false, err
	}
	names := make([]ipalloc.PeerName, 0, len(peers))
	for p := range peers {
		names = append(names, ipalloc.PeerName(p))
	}
	_, self = peers[string(r.name)]
	return self, r.ipam.SetExternalMembers(names)
}

// routineKube feeds the node list to the mesh as join targets, records the
// ring's first claim in the ConfigMap once there is a ring, and clears the
// node's NetworkUnavailable condition once the router is ready.
func (r *Router) routineKube(ctx context.Context) {
	events, unsubscribe := r.mesh.Subscribe(16)
	var wg sync.WaitGroup
	wg.Go(func() { kickReclaimOnPeerLoss(events, r.kube.PeerLost) })
	defer wg.Wait()
	defer unsubscribe() // closes events: the goroutine ends
	var joined []string
	recorded, available := false, false
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	membersRead, selfRead, failed := false, false, 0
	for round := 0; ; round++ {
		if round%kubeMembersEvery == 0 || !membersRead || !selfRead {
			// Every round until the first read succeeds: a peer that
			// started without state allocates nothing before it. And
			// until the read names this peer (kube.Kube registers it, and
			// signals Changes once it has): the allocator asks for no
			// space before that. Bounded, so that the rest of the round
			// (the mesh's targets from the node list) goes on while the
			// ConfigMap cannot be read.
			mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			self, err := r.kubeMembers(mctx)
			cancel()
			switch {
			case err == nil:
				membersRead = true
				selfRead = selfRead || self
			case ctx.Err() != nil:
			case !membersRead:
				failed++
				if failed%12 != 1 { // the first, then once a minute
					break
				}
				r.log.Warn("kubernetes: reading the peers registered in the ConfigMap failed; retrying every 5s "+
					"(a router that started without state allocates nothing before it has read them)", "err", err)
			default:
				r.log.Debug("kubernetes: reading the registered peers failed; retrying", "err", err)
			}
		}
		if addrs := r.kube.PeerAddrs(); r.kube.Synced() && (joined == nil || !slices.Equal(addrs, joined)) {
			// The node list is the cluster: a deleted Node's address is
			// no longer a target (nor a remembered one).
			if err := r.mesh.SetTargets(addrs...); err != nil {
				r.log.Warn("kubernetes: a node address is not usable as a peer", "err", err)
			} else {
				joined = append([]string{}, addrs...)
			}
		}
		if r.kube.Synced() {
			r.forgetGonePeers(r.kube.PeerAddrs())
		}
		if !recorded {
			recorded = r.recordClaim(ctx)
		}
		if ok, _ := r.Ready(); ok && !available {
			if err := r.kube.SetNetworkAvailable(ctx); err == nil {
				available = true
				r.log.Info("kubernetes: cleared the node's NetworkUnavailable condition", "node", r.cfg.NodeName)
			} else if ctx.Err() == nil {
				r.log.Warn("kubernetes: cannot clear the node's NetworkUnavailable condition; retrying", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-r.kube.Changes():
		case <-t.C:
		}
	}
}

// kickReclaimOnPeerLoss calls kick for every mesh event saying that a
// peer became unreachable or left (or that events were lost), until events
// is closed: a deleted Node's peer is reclaimed once the mesh no longer
// counts it alive (kube.Kube.PeerLost).
func kickReclaimOnPeerLoss(events <-chan mesh.Event, kick func()) {
	for ev := range events {
		if ev.Kind == mesh.EventUnreachable || ev.Kind == mesh.EventLeft || ev.Dropped > 0 {
			kick()
		}
	}
}

// takeOut is weft reset --force for a router stopped on a Node marked
// with kube.ResetLabel (the DaemonSet's affinity removed its pod there):
// it hands this peer's ranges to a live peer, removes the CNI config (the
// node turns NotReady), and has Run remove the bridge and the state, so
// that the node stays out until the label is removed. If the handover
// fails, only the CNI config goes: the ranges stay in the state, and
// deleting the Node has another router reclaim them.
func (r *Router) takeOut() {
	r.log.Info("kubernetes: this node is marked "+kube.ResetLabel+": taking it out of the cluster (as weft reset --force)", "node", r.cfg.NodeName)
	ctx, cancel := context.WithTimeout(context.Background(), resetWait)
	defer cancel()
	res, err := r.leave(ctx, true)
	r.setReady(false, "node marked "+kube.ResetLabel+": leaving the cluster")
	if _, _, rerr := removeConfList(r.cfg.CNIConfDir); rerr != nil {
		r.log.Error("kubernetes: could not remove the CNI config", "err", rerr)
	}
	if err != nil {
		r.log.Error("kubernetes: could not hand this peer's ranges over; the CNI config is removed (the node is NotReady), "+
			"the bridge and the state stay: delete the Node to have another router reclaim the ranges, or run weft reset --force here", "err", err)
		return
	}
	r.log.Info("kubernetes: handed this peer's ranges over; removing the bridge, the CNI config and the state", "heir", res.Heir, "addresses", res.Size, "dropped", len(res.Dropped))
	r.takenOut.Store(true)
}

// removeCNIConfigOnStop is what a router stopped while weft's DaemonSet
// is deleted (an uninstall) does: it removes the CNI config, so that the
// node turns NotReady instead of staying Ready with a network that no
// longer runs. Bridge, routes and state stay: deploy/uninstall removes
// them, and a reinstall adopts them.
func (r *Router) removeCNIConfigOnStop() {
	r.setReady(false, "weft's DaemonSet was deleted")
	removed, conf, err := removeConfList(r.cfg.CNIConfDir)
	switch {
	case err != nil:
		r.log.Error("kubernetes: could not remove the CNI config", "err", err)
	case removed:
		r.log.Info("kubernetes: weft's DaemonSet was deleted: removed the CNI config; the node is NotReady until a pod network is installed "+
			"(deploy/uninstall cleans the rest)", "path", conf)
	}
}

// forgetGonePeers drops from the mesh's view the peers that are gone for
// good: not alive, on no Node's address any more, and owning nothing in
// the ring (their ranges were reclaimed). So a deleted and reclaimed Node
// is not dialled, shown as a failed connection, nor remembered for the
// next start.
func (r *Router) forgetGonePeers(nodeAddrs []string) {
	onNode := map[string]bool{}
	for _, a := range nodeAddrs {
		onNode[a] = true
	}
	owners := r.ipam.Ring().Peers()
	for _, p := range r.mesh.Peers() {
		if p.Self || p.State == mesh.StateAlive || p.State == mesh.StateSuspect || !p.Addr.IsValid() {
			continue
		}
		if onNode[p.Addr.Addr().String()] || slices.Contains(owners, ipalloc.PeerName(p.Name)) {
			continue
		}
		if err := r.mesh.Forget(p.Name); err != nil {
			r.log.Debug("kubernetes: not forgetting a peer", "peer", p.Name, "err", err)
		}
	}
}

// recordClaim writes the ring's first claim into the ConfigMap, once the
// ring is claimed, and reports whether that is done. A different claim
// recorded there means this ring was claimed apart from the cluster's:
// the allocator refuses the other ring, and the log says how to recover.
func (r *Router) recordClaim(ctx context.Context) bool {
	ring := r.ipam.Ring()
	if ring.Empty() || ring.Seed == 0 {
		return false
	}
	mine := kube.Claim{Seed: ring.Seed, Universe: r.cfg.Universe, By: r.name, Time: time.Now().UTC()}
	got, err := r.kube.RecordClaim(ctx, mine)
	if err != nil {
		var corrupt *kube.CorruptError
		if errors.As(err, &corrupt) || ctx.Err() != nil {
			return false
		}
		r.log.Debug("kubernetes: recording the first claim failed; retrying", "err", err)
		return false
	}
	if got.Seed != ring.Seed {
		r.log.Error(fmt.Sprintf("kubernetes: this peer's ring (seed %s) is not the cluster's (seed %s, recorded by %s): it was claimed apart; "+
			"take this node out with 'weft reset --force' and restart it to join the cluster's ring", ring.Seed, got.Seed, got.By))
	}
	return true
}
