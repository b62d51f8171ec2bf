package kube

import (
	"context"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// newDaemonSetInformer watches weft's own DaemonSet (by name: RBAC grants
// get, list and watch on that one only) for its deletion. The watch is made
// while the router runs: `kubectl delete -k` deletes the ServiceAccount
// too, whose token then no longer authenticates a new request, but a watch
// already open still delivers the DaemonSet's deletion.
func (k *Kube) newDaemonSetInformer() cache.SharedIndexInformer {
	dss := k.cfg.Client.AppsV1().DaemonSets(k.cfg.Namespace)
	sel := fields.OneTermEqualSelector("metadata.name", k.cfg.DaemonSet).String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, opts metav1.ListOptions) (runtime.Object, error) {
			opts.FieldSelector = sel
			l, err := dss.List(ctx, opts)
			k.informerCall(ctx, op{verb: "list", resource: "daemonsets", ns: k.cfg.Namespace, name: k.cfg.DaemonSet}, err)
			return l, err
		},
		WatchFuncWithContext: func(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error) {
			opts.FieldSelector = sel
			w, err := dss.Watch(ctx, opts)
			k.informerCall(ctx, op{verb: "watch", resource: "daemonsets", ns: k.cfg.Namespace, name: k.cfg.DaemonSet}, err)
			return w, err
		},
	}
	inf := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, k.cfg.Client), &appsv1.DaemonSet{}, 10*time.Minute, cache.Indexers{})
	_ = inf.SetTransform(func(obj any) (any, error) {
		ds, ok := obj.(*appsv1.DaemonSet)
		if !ok {
			return obj, nil
		}
		return &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{
			Name: ds.Name, Namespace: ds.Namespace, UID: ds.UID, ResourceVersion: ds.ResourceVersion, DeletionTimestamp: ds.DeletionTimestamp,
		}}, nil
	})
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) {
		k.log.Debug("kubernetes: DaemonSet watch ended; the informer lists and watches again", "err", err)
	})
	seen := func(obj any) {
		if ds, ok := obj.(*appsv1.DaemonSet); ok && ds.DeletionTimestamp != nil {
			k.daemonSetGone("being deleted")
		} else if ok && k.dsGone.Swap(false) {
			k.log.Info("kubernetes: weft's DaemonSet is back", "daemonset", k.cfg.Namespace+"/"+k.cfg.DaemonSet)
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    seen,
		UpdateFunc: func(_, obj any) { seen(obj) },
		DeleteFunc: func(any) { k.daemonSetGone("deleted") },
	})
	return inf
}

func (k *Kube) daemonSetGone(how string) {
	if !k.dsGone.Swap(true) {
		k.log.Info("kubernetes: weft's DaemonSet is "+how+" (uninstall): when this router stops it removes the CNI config, so that the node turns NotReady",
			"daemonset", k.cfg.Namespace+"/"+k.cfg.DaemonSet)
	}
}

// DaemonSetGone reports whether weft's DaemonSet (Config.DaemonSet) was
// seen deleted, or being deleted: weft is being uninstalled.
func (k *Kube) DaemonSetGone() bool { return k.dsGone.Load() }
