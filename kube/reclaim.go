package kube

import (
	"context"
	"fmt"
	"maps"
	"slices"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Reclaiming the ranges of a peer whose Node was deleted.
//
// Every live router runs the pass below on each Node deletion and every
// Config.Resync; it looks at the peers of the ConfigMap whose Node is gone
// (the informer no longer has it, and a GET of it says NotFound, so a lag
// of the informer never counts; a Node that is merely NotReady is never
// touched). For each, the routers race to write a marker naming themselves
// as its reclaimer, by compare-and-swap on the ConfigMap; the one whose
// write succeeds calls Config.Reclaim and then, by compare-and-swap again,
// removes the peer's entry and the marker and notes the reclaim in the
// "reclaimed" key. The others see the marker and leave it.
//
// A reclaimer can die too. Since every reclaimer registered itself before
// it could write a marker, a marker or a reclaimed note whose reclaimer
// has no entry any more (its own Node was deleted and it was reclaimed in
// turn) is stale: the marker may then be overwritten, and the note is
// turned back into a peer entry without a marker, so that the next winner
// calls Config.Reclaim for that peer again. This is the order the
// allocator asks for: reclaim the dead reclaimer first, then its peer.

// maxRounds bounds the passes run back to back while they make progress.
const maxRounds = 8

// canReclaim reports whether this router takes part in reclaims now.
func (k *Kube) canReclaim() bool {
	if k.cfg.Reclaim == nil {
		return false
	}
	select {
	case <-k.synced:
	default:
		return false
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.registered
}

// reconcile runs reclaim passes until one changes nothing.
func (k *Kube) reconcile(ctx context.Context) {
	if !k.canReclaim() {
		return
	}
	k.passMu.Lock()
	defer k.passMu.Unlock()
	for range maxRounds {
		progress, err := k.reclaimPass(ctx)
		if err != nil {
			if ctx.Err() == nil && k.sayOnce("pass", err.Error()) {
				k.log.Error("kubernetes: reclaim pass failed; retrying at the next pass", "err", err)
			}
			return
		}
		k.forget("pass")
		if !progress {
			return
		}
	}
}

// reclaimPass is one look at the ConfigMap. It reports whether it changed
// something (another pass may then find more to do).
func (k *Kube) reclaimPass(ctx context.Context) (bool, error) {
	cm, found, err := k.getConfigMap(ctx)
	if err != nil || !found {
		return false, err
	}
	peers, err := k.decodePeers(cm.Data)
	if err != nil {
		return false, err
	}
	done, err := k.decodeReclaimed(cm.Data)
	if err != nil {
		return false, err
	}
	if revive := staleReclaims(peers, done, k.cfg.PeerName); len(revive) > 0 {
		return true, k.revive(ctx)
	}
	progress := false
	for _, p := range slices.Sorted(maps.Keys(peers)) {
		r := peers[p]
		if r.CalledOff == k.cfg.PeerName && r.Reclaimer == "" && k.cfg.Withdraw != nil {
			did, err := k.withdraw(ctx, p, r)
			if err != nil {
				return progress, err
			}
			progress = progress || did
		}
		if p == k.cfg.PeerName || k.nodeKnown(r.Node) {
			continue
		}
		did, err := k.reclaimPeer(ctx, p, r, peers)
		if err != nil {
			return progress, err
		}
		progress = progress || did
	}
	return progress, nil
}

// staleReclaims are the reclaimed notes whose reclaimer has no entry any
// more, for peers that have none either.
func staleReclaims(peers map[string]PeerRecord, done map[string]ReclaimRecord, self string) []string {
	var out []string
	for x, rec := range done {
		if _, live := peers[rec.By]; !live && rec.By != self {
			if _, has := peers[x]; !has {
				out = append(out, x)
			}
		}
	}
	slices.Sort(out)
	return out
}

// revive turns the stale reclaimed notes back into peer entries without a
// marker, so that a live router reclaims them again.
func (k *Kube) revive(ctx context.Context) error {
	var revived []string
	err := k.modify(ctx, "reviving reclaims of reclaimed peers", func(data map[string]string) (bool, error) {
		peers, err := k.decodePeers(data)
		if err != nil {
			return false, err
		}
		done, err := k.decodeReclaimed(data)
		if err != nil {
			return false, err
		}
		revived = staleReclaims(peers, done, k.cfg.PeerName)
		if len(revived) == 0 {
			return false, nil
		}
		for _, x := range revived {
			peers[x] = PeerRecord{Node: done[x].Node}
			delete(done, x)
		}
		if err := encode(data, KeyPeers, peers); err != nil {
			return false, err
		}
		return true, encode(data, KeyReclaimed, done)
	})
	for _, x := range revived {
		k.log.Info("kubernetes: the peer that reclaimed "+x+" is gone too; "+x+" is to be reclaimed again", "peer", x)
	}
	return err
}

// nodeGone confirms with the API server that node no longer exists.
func (k *Kube) nodeGone(ctx context.Context, node string) (bool, error) {
	o := op{verb: "get", resource: "nodes", name: node}
	err := k.call(ctx, o, func(ctx context.Context) error {
		_, err := k.cfg.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		return err
	})
	switch {
	case apierrors.IsNotFound(err):
		return true, nil
	case err != nil:
		return false, err
	}
	return false, nil
}

// reclaimPeer takes part in the reclaim of peer p, whose node is gone per
// the informer. It reports whether it changed the ConfigMap.
func (k *Kube) reclaimPeer(ctx context.Context, p string, r PeerRecord, peers map[string]PeerRecord) (bool, error) {
	self := k.cfg.PeerName
	if r.Reclaimer != "" && r.Reclaimer != self {
		if _, live := peers[r.Reclaimer]; live {
			k.sayReclaimer(p, r)
			return false, nil
		}
	}
	gone, err := k.nodeGone(ctx, r.Node)
	if err != nil || !gone {
		return false, err
	}
	if k.cfg.PeerAlive != nil && k.cfg.PeerAlive(p) {
		if k.sayOnce("alive/"+p, "") {
			k.log.Warn("kubernetes: node "+r.Node+" deleted, but peer "+p+" still answers in the mesh: not reclaiming it while it does",
				"node", r.Node, "peer", p)
		}
		return false, nil
	}
	k.forget("alive/" + p)

	// Race to be the reclaimer.
	var won bool
	var cur PeerRecord
	err = k.modify(ctx, "marking the reclaim of "+p, func(data map[string]string) (bool, error) {
		won = false
		peers, err := k.decodePeers(data)
		if err != nil {
			return false, err
		}
		var ok bool
		cur, ok = peers[p]
		if !ok || cur.Node != r.Node {
			return false, nil // reclaimed meanwhile, or re-registered elsewhere
		}
		if cur.Reclaimer == self {
			won = true
			return false, nil
		}
		if _, live := peers[cur.Reclaimer]; cur.Reclaimer != "" && live {
			return false, nil
		}
		prev := cur.Reclaimer
		cur.Reclaimer, cur.ReclaimStarted = self, k.cfg.Now().UTC()
		peers[p] = cur
		won = true
		cur.Reclaimer = prev // for the log below
		return true, encode(data, KeyPeers, peers)
	})
	if err != nil {
		return false, err
	}
	if !won {
		if cur.Reclaimer != "" && cur.Node == r.Node {
			k.sayReclaimer(p, cur)
		}
		return false, nil
	}
	switch cur.Reclaimer {
	case "":
		k.log.Info(fmt.Sprintf("node %s deleted: reclaiming peer %s's ranges", r.Node, p), "node", r.Node, "peer", p)
	case self:
		k.log.Info(fmt.Sprintf("node %s deleted: reclaiming peer %s's ranges (resuming)", r.Node, p), "node", r.Node, "peer", p)
	default:
		k.log.Info(fmt.Sprintf("node %s deleted: reclaiming peer %s's ranges, taking over from %s, which is gone too", r.Node, p, cur.Reclaimer),
			"node", r.Node, "peer", p)
	}

	if err := k.cfg.Reclaim(ctx, p); err != nil {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		if k.sayOnce("callback/"+p, err.Error()) {
			k.log.Error(fmt.Sprintf("node %s deleted: reclaiming peer %s's ranges failed; retrying at the next pass", r.Node, p),
				"node", r.Node, "peer", p, "err", err)
		}
		return false, nil
	}
	k.forget("callback/" + p)

	// Done: remove the entry and the marker, note the reclaim.
	var finished bool
	err = k.modify(ctx, "finishing the reclaim of "+p, func(data map[string]string) (bool, error) {
		finished = false
		peers, err := k.decodePeers(data)
		if err != nil {
			return false, err
		}
		done, err := k.decodeReclaimed(data)
		if err != nil {
			return false, err
		}
		if cur, ok := peers[p]; !ok || cur.Reclaimer != self {
			return false, nil
		}
		now := k.cfg.Now().UTC()
		delete(peers, p)
		done[p] = ReclaimRecord{Node: r.Node, By: self, At: now}
		for x, rec := range done {
			if now.Sub(rec.At) > k.cfg.TombstoneTTL {
				delete(done, x)
			}
		}
		if err := encode(data, KeyPeers, peers); err != nil {
			return false, err
		}
		finished = true
		return true, encode(data, KeyReclaimed, done)
	})
	if err != nil {
		return false, err
	}
	if !finished {
		k.log.Warn(fmt.Sprintf("node %s deleted: peer %s was reclaimed by this peer, but its entry changed meanwhile (re-registered?); left as it is", r.Node, p),
			"node", r.Node, "peer", p)
		return true, nil
	}
	k.metrics.reclaims.Inc()
	k.log.Info(fmt.Sprintf("node %s deleted: peer %s reclaimed", r.Node, p), "node", r.Node, "peer", p)
	return true, nil
}

// withdraw calls off this router's reclaim of p, which registered again
// (it came back), and then clears the note. It reports whether it changed
// the ConfigMap.
func (k *Kube) withdraw(ctx context.Context, p string, r PeerRecord) (bool, error) {
	if err := k.cfg.Withdraw(ctx, p); err != nil {
		if ctx.Err() != nil {
			return false, ctx.Err()
		}
		if k.sayOnce("withdraw/"+p, err.Error()) {
			k.log.Error("kubernetes: peer "+p+" came back (registered again on node "+r.Node+"), but withdrawing this peer's reclaim of it failed; retrying at the next pass",
				"peer", p, "node", r.Node, "err", err)
		}
		return false, nil
	}
	k.forget("withdraw/" + p)
	var cleared bool
	err := k.modify(ctx, "clearing the called-off reclaim of "+p, func(data map[string]string) (bool, error) {
		cleared = false
		peers, err := k.decodePeers(data)
		if err != nil {
			return false, err
		}
		cur, ok := peers[p]
		if !ok || cur.CalledOff != k.cfg.PeerName {
			return false, nil
		}
		cur.CalledOff = ""
		peers[p] = cur
		cleared = true
		return true, encode(data, KeyPeers, peers)
	})
	if err != nil || !cleared {
		return false, err
	}
	k.log.Info("kubernetes: peer "+p+" came back (registered again on node "+r.Node+"): this peer's reclaim of it is called off",
		"peer", p, "node", r.Node)
	return true, nil
}

// sayReclaimer logs, once per reclaimer, that another peer reclaims p.
func (k *Kube) sayReclaimer(p string, r PeerRecord) {
	if k.sayOnce("reclaimer/"+p, r.Reclaimer) {
		k.log.Info(fmt.Sprintf("node %s deleted: peer %s is reclaiming %s", r.Node, r.Reclaimer, p),
			"node", r.Node, "peer", p, "reclaimer", r.Reclaimer, "since", r.ReclaimStarted)
	}
}
