package kube

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/rest"
)

const testKubeconfig = `apiVersion: v1
kind: Config
clusters:
- name: c
  cluster:
    server: https://127.0.0.1:6443
    insecure-skip-tls-verify: true
users:
- name: u
  user:
    token: secret
contexts:
- name: x
  context:
    cluster: c
    user: u
current-context: x
`

func TestRESTConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(path, []byte(testKubeconfig), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := RESTConfig(path, "1.2.3")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.UserAgent != "weft/1.2.3" || cfg.Host != "https://127.0.0.1:6443" || cfg.QPS != clientQPS || cfg.Timeout != 0 {
		t.Errorf("config %+v", cfg)
	}
	if _, err := NewClient(path, ""); err != nil {
		t.Error(err)
	}

	missing := filepath.Join(t.TempDir(), "nope")
	if _, err := RESTConfig(missing, "x"); err == nil || !strings.Contains(err.Error(), "--kubeconfig "+missing) {
		t.Errorf("missing file: %v", err)
	}
	bad := filepath.Join(t.TempDir(), "bad")
	if err := os.WriteFile(bad, []byte("{not yaml"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := RESTConfig(bad, "x"); err == nil || !strings.Contains(err.Error(), "--kubeconfig "+bad) {
		t.Errorf("bad file: %v", err)
	}

	t.Setenv("KUBERNETES_SERVICE_HOST", "")
	t.Setenv("KUBERNETES_SERVICE_PORT", "")
	if _, err := RESTConfig("", "x"); err == nil || !strings.Contains(err.Error(), "not running in a pod") {
		t.Errorf("in-cluster outside a pod: %v", err)
	}
}

// Server names the API server of a real client, and does not panic on a
// fake one.
func TestServer(t *testing.T) {
	cs, err := kubernetes.NewForConfig(&rest.Config{Host: "https://10.96.0.1:443"})
	if err != nil {
		t.Fatal(err)
	}
	k, err := New(Config{Client: cs, NodeName: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := k.Server(); got != "https://10.96.0.1:443" {
		t.Errorf("Server() = %q", got)
	}
	f, err := New(Config{Client: fake.NewClientset(), NodeName: "n1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := f.Server(); got != "(unknown)" {
		t.Errorf("fake: Server() = %q", got)
	}
}
