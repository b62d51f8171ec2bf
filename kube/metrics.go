package kube

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/weft-net/weft/internal/promreg"
)

// metrics are the package's Prometheus collectors. They always exist
// (tests read them); they are registered only when Config.Registerer is set.
type metrics struct {
	apiErrors *prometheus.CounterVec // operation
	conflicts prometheus.Counter
	reclaims  prometheus.Counter
	nodes     prometheus.GaugeFunc
}

func newMetrics(reg prometheus.Registerer, k *Kube) (*metrics, error) {
	m := &metrics{
		apiErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "weft_kube_api_errors_total",
			Help: "Failed Kubernetes API calls by operation (e.g. \"update configmaps\", \"watch nodes\"); conflicts and not-found answers are not errors.",
		}, []string{"operation"}),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weft_kube_configmap_conflicts_total",
			Help: "Compare-and-swap writes of the weft ConfigMap that lost to another writer and were retried.",
		}),
		reclaims: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "weft_kube_reclaims_total",
			Help: "Peers of deleted Nodes whose ranges this router reclaimed.",
		}),
		nodes: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "weft_kube_nodes",
			Help: "Nodes in the cluster, as this router's informer sees them.",
		}, func() float64 { return float64(k.NodeCount()) }),
	}
	if err := promreg.Register(reg, m.apiErrors, m.conflicts, m.reclaims, m.nodes); err != nil {
		return nil, err
	}
	return m, nil
}
