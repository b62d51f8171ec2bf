package kubenodes

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"

	"archive/tar"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/weft-net/weft/e2e/kubeapi"
)

// ProbeImage is the test pods' image: netprobe alone.
const ProbeImage = "weft-e2e/netprobe:test"

// BuildProbeImage builds netprobe (static) and writes it as an image
// tarball into dir, for Options.Images; it returns the tarball's path.
func BuildProbeImage(ctx context.Context, dir string) (string, error) {
	root, err := kubeapi.RepoRoot()
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "netprobe")
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./e2e/kubenodes/netprobe")
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("kubenodes: building netprobe: %w: %s", err, bytes.TrimSpace(out))
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return "", err
	}
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	if err := tw.WriteHeader(&tar.Header{Name: "netprobe", Mode: 0o755, Size: int64(len(data)), Typeflag: tar.TypeReg}); err != nil {
		return "", err
	}
	if _, err := tw.Write(data); err != nil {
		return "", err
	}
	if err := tw.Close(); err != nil {
		return "", err
	}
	l, err := tarball.LayerFromReader(bytes.NewReader(layer.Bytes()))
	if err != nil {
		return "", err
	}
	img, err := mutate.AppendLayers(empty.Image, l)
	if err != nil {
		return "", err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return "", err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", runtime.GOARCH
	cf.Config = v1.Config{Entrypoint: []string{"/netprobe"}, WorkingDir: "/"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return "", err
	}
	tag, err := name.NewTag(ProbeImage)
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "netprobe-image.tar")
	if err := tarball.WriteToFile(out, tag, img); err != nil {
		return "", fmt.Errorf("kubenodes: writing %s: %w", out, err)
	}
	return out, nil
}
