package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// addressTypes are the Node address types weft can join peers at; the
// value says whether it must be an IPv4 address (the mesh's underlay is
// IPv4) or is a DNS name.
var addressTypes = map[corev1.NodeAddressType]bool{
	corev1.NodeInternalIP:  true,
	corev1.NodeExternalIP:  true,
	corev1.NodeHostName:    false,
	corev1.NodeInternalDNS: false,
	corev1.NodeExternalDNS: false,
}

// fallbackOrder is tried, after the chosen type, for a node that has no
// usable address of the chosen type.
var fallbackOrder = []corev1.NodeAddressType{corev1.NodeInternalIP, corev1.NodeExternalIP}

// ResetLabel on a Node marks it for removal from weft: the DaemonSet's
// node affinity keeps weft's pod off it, and the router, stopped there,
// takes the node out of the cluster (hands its ranges over, removes the
// CNI config, the bridge and its state) instead of leaving them for a
// restart. docs/kubernetes.md, "Taking a node out".
const ResetLabel = "weft.works/reset"

// nodeInfo is what weft uses of a Node.
type nodeInfo struct {
	addr  string                 // "" when the node has no usable address
	typ   corev1.NodeAddressType // of addr
	reset bool                   // it has ResetLabel
}

// NodeAddress picks the address of n that peers are joined at: the first
// usable one of type want (an IPv4 address for the IP types, a DNS name
// for the others), else the first of InternalIP, then ExternalIP. It
// returns the type it used, and ok false when n has no usable address.
func NodeAddress(n *corev1.Node, want corev1.NodeAddressType) (addr string, typ corev1.NodeAddressType, ok bool) {
	for _, t := range append([]corev1.NodeAddressType{want}, fallbackOrder...) {
		for _, a := range n.Status.Addresses {
			if a.Type == t && usable(t, a.Address) {
				return a.Address, t, true
			}
		}
	}
	return "", "", false
}

func usable(t corev1.NodeAddressType, a string) bool {
	if addressTypes[t] {
		ip, err := netip.ParseAddr(a)
		return err == nil && ip.Is4() && !ip.IsUnspecified()
	}
	return len(validation.IsDNS1123Subdomain(a)) == 0
}

// newNodeInformer lists and watches the Nodes through the client, counting
// the calls' failures and successes as the other API calls are counted
// (the informer's own reflector retries with backoff). The second result
// reports whether the handler that fills Kube.nodes has seen the first
// list: the informer's own HasSynced says only that its store has, and
// the handler may still be delivering it.
func (k *Kube) newNodeInformer() (cache.SharedIndexInformer, cache.InformerSynced, error) {
	nodes := k.cfg.Client.CoreV1().Nodes()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			l, err := nodes.List(ctx, opts)
			k.informerCall(ctx, op{verb: "list", resource: "nodes"}, err)
			return l, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			w, err := nodes.Watch(ctx, opts)
			k.informerCall(ctx, op{verb: "watch", resource: "nodes"}, err)
			return w, err
		},
	}
	inf := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, k.cfg.Client), &corev1.Node{}, 10*time.Minute, cache.Indexers{})
	// Keep only what weft reads: a large cluster's Nodes carry image lists
	// and more that would otherwise sit in every router's memory.
	_ = inf.SetTransform(slimNode)
	// The calls' own errors are logged above; the handler sees them again
	// wrapped, and the ends of watches, which are routine.
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		k.log.Debug("kubernetes: node watch ended; the informer lists and watches again", "err", err)
	})
	reg, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { k.nodeSeen(obj) },
		UpdateFunc: func(_, obj any) { k.nodeSeen(obj) },
		DeleteFunc: k.nodeDeleted,
	})
	if err != nil { // only if the informer had stopped: it has not started
		return nil, nil, fmt.Errorf("kube: adding the node handler: %w", err)
	}
	return inf, reg.HasSynced, nil
}

// slimNode strips a Node down to its name, version and addresses.
func slimNode(obj any) (any, error) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil // e.g. cache.DeletedFinalStateUnknown
	}
	var labels map[string]string
	if v, ok := n.Labels[ResetLabel]; ok {
		labels = map[string]string{ResetLabel: v}
	}
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion, Labels: labels},
		Status:     corev1.NodeStatus{Addresses: n.Status.Addresses},
	}, nil
}

func (k *Kube) informerCall(ctx context.Context, o op, err error) {
	switch {
	case err == nil:
		k.apiOK(o)
	case ctx.Err() == nil && !answer(err):
		k.apiFailed(o, err)
	}
}

// nodeSeen records an added or updated Node.
func (k *Kube) nodeSeen(obj any) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	addr, typ, found := NodeAddress(n, k.cfg.AddressType)
	_, reset := n.Labels[ResetLabel]
	info := nodeInfo{addr: addr, typ: typ, reset: reset}
	k.mu.Lock()
	old, had := k.nodes[n.Name]
	k.nodes[n.Name] = info
	k.mu.Unlock()
	if had && old == info {
		return
	}
	k.signal(k.seen)
	if n.Name == k.cfg.NodeName && info.reset != old.reset {
		if info.reset {
			k.log.Info("kubernetes: this node is labelled "+ResetLabel+": when the router stops it takes the node out of the cluster (hands its ranges over, removes the CNI config, the bridge and its state)", "node", n.Name)
		} else if had {
			k.log.Info("kubernetes: this node's "+ResetLabel+" label is gone: a stop leaves the node as it is again", "node", n.Name)
		}
	}
	switch {
	case !found:
		k.log.Warn("kubernetes: node has no usable address; it is not joined until it has one",
			"node", n.Name, "address-type", k.cfg.AddressType, "addresses", fmt.Sprint(n.Status.Addresses))
	case typ != k.cfg.AddressType:
		k.log.Warn("kubernetes: node has no "+string(k.cfg.AddressType)+" address; using its "+string(typ),
			"node", n.Name, "address", addr)
	default:
		k.log.Debug("kubernetes: node", "node", n.Name, "address", addr)
	}
	k.signal(k.changes)
}

// nodeDeleted records a deleted Node and starts a reclaim pass.
func (k *Kube) nodeDeleted(obj any) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	n, ok := obj.(*corev1.Node)
	if !ok {
		return
	}
	k.mu.Lock()
	delete(k.nodes, n.Name)
	k.mu.Unlock()
	k.log.Info("kubernetes: node deleted", "node", n.Name)
	k.signal(k.changes)
	k.signal(k.kick)
}

// PeerAddrs returns the addresses of the other nodes (this one excluded),
// sorted: the targets to join, as --peers entries without a port.
func (k *Kube) PeerAddrs() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for name, n := range k.nodes {
		if name != k.cfg.NodeName && n.addr != "" {
			out = append(out, n.addr)
		}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// MarkedForReset reports whether this node's Node, as last seen, carries
// ResetLabel: the operator is taking the node out of weft.
func (k *Kube) MarkedForReset() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.nodes[k.cfg.NodeName].reset
}

// NodeCount is the number of Nodes in the cluster, this one included (0
// until the list has synced; see WaitSynced).
func (k *Kube) NodeCount() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.nodes)
}

// nodeKnown reports whether the informer has a Node of that name.
func (k *Kube) nodeKnown(name string) bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	_, ok := k.nodes[name]
	return ok
}

// Condition of the node that SetNetworkAvailable sets.
const (
	ConditionReason  = "WeftIsUp"
	ConditionMessage = "weft is running on this node"
)

// networkAvailablePatch is the strategic merge patch of the node's status
// that sets NetworkUnavailable to False (conditions merge by type).
func networkAvailablePatch(now time.Time) ([]byte, error) {
	t := metav1.NewTime(now)
	return json.Marshal(map[string]any{
		"status": map[string]any{
			"conditions": []corev1.NodeCondition{{
				Type:               corev1.NodeNetworkUnavailable,
				Status:             corev1.ConditionFalse,
				Reason:             ConditionReason,
				Message:            ConditionMessage,
				LastTransitionTime: t,
				LastHeartbeatTime:  t,
			}},
		},
	})
}

// SetNetworkAvailable clears this node's NetworkUnavailable condition
// (status False, reason WeftIsUp), as the router does once it is ready.
// It retries with backoff until it succeeds or ctx ends.
func (k *Kube) SetNetworkAvailable(ctx context.Context) error {
	patch, err := networkAvailablePatch(k.cfg.Now())
	if err != nil {
		return err
	}
	o := op{verb: "patch", resource: "nodes/status", name: k.cfg.NodeName}
	err = k.call(ctx, o, func(ctx context.Context) error {
		_, err := k.cfg.Client.CoreV1().Nodes().Patch(ctx, k.cfg.NodeName, types.StrategicMergePatchType, patch, metav1.PatchOptions{}, "status")
		return err
	})
	if err != nil {
		return fmt.Errorf("clearing NetworkUnavailable on node %s: %w", k.cfg.NodeName, err)
	}
	k.log.Info("kubernetes: node condition NetworkUnavailable=False", "node", k.cfg.NodeName, "reason", ConditionReason)
	return nil
}
