package kube

import (
	"errors"
	"fmt"
	"os"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Client rate limits: a router makes a few calls a minute; the burst
// covers start-up (list, watch, ConfigMap read and write, status patch).
const (
	clientQPS   = 5
	clientBurst = 20
)

// RESTConfig returns the client configuration: the in-cluster one (the
// pod's ServiceAccount) when kubeconfig is "", else the file's current
// context. The user agent is "weft/<version>". Requests carry no global
// timeout, which would cut the node watch; each call of this package has
// its own.
func RESTConfig(kubeconfig, version string) (*rest.Config, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
		if errors.Is(err, rest.ErrNotInCluster) {
			return nil, errors.New("kubernetes: not running in a pod (KUBERNETES_SERVICE_HOST and _PORT are unset): give --kubeconfig")
		}
		if err != nil {
			return nil, fmt.Errorf("kubernetes: in-cluster config (the pod's ServiceAccount token): %w", err)
		}
	} else {
		if _, err := os.Stat(kubeconfig); err != nil {
			return nil, fmt.Errorf("kubernetes: --kubeconfig %s: %w", kubeconfig, err)
		}
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("kubernetes: --kubeconfig %s: %w", kubeconfig, err)
		}
	}
	if version == "" {
		version = "dev"
	}
	cfg.UserAgent = "weft/" + version
	cfg.QPS, cfg.Burst = clientQPS, clientBurst
	return cfg, nil
}

// NewClient returns a clientset for RESTConfig(kubeconfig, version).
func NewClient(kubeconfig, version string) (kubernetes.Interface, error) {
	cfg, err := RESTConfig(kubeconfig, version)
	if err != nil {
		return nil, err
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: client: %w", err)
	}
	return c, nil
}
