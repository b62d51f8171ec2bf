package kube

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// CountNodes lists the Nodes once, through the API server rather than the
// informer, and returns how many there are: for a decision a router makes
// before Run (how many nodes the first claim's consensus needs). It
// retries failures until it gets an answer or ctx ends.
func (k *Kube) CountNodes(ctx context.Context) (int, error) {
	n := 0
	err := k.call(ctx, op{verb: "list", resource: "nodes"}, func(ctx context.Context) error {
		// ResourceVersion "0": any recent list will do, from the API
		// server's cache, as the informer's first list.
		l, err := k.cfg.Client.CoreV1().Nodes().List(ctx, metav1.ListOptions{ResourceVersion: "0"})
		if err == nil {
			n = len(l.Items)
		}
		return err
	})
	return n, err
}
