package cni

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/weft-net/weft/api"
	"github.com/weft-net/weft/cni/routertest"
)

func TestRouterErrorTable(t *testing.T) {
	apiErr := func(code, msg string) error {
		return &api.Error{Status: 503, ErrorBody: api.ErrorBody{Code: code, Message: msg}}
	}
	tests := []struct {
		name     string
		err      error
		wantCode uint
		wantMsg  string
	}{
		{"not ready, bare reason", apiErr(api.CodeNotReady, "joining the mesh"),
			types.ErrTryAgainLater, "weft router not ready: joining the mesh; try again later"},
		{"wrapped", fmt.Errorf("x: %w", apiErr(api.CodeNotReady, "r")), types.ErrTryAgainLater, "weft router not ready: r"},
		{"unreachable", fmt.Errorf("%w at /run/weft/weft.sock: connection refused", api.ErrUnreachable),
			types.ErrTryAgainLater, "try again when the weft router is up"},
		{"invalid", apiErr(api.CodeInvalid, "container id is empty"), types.ErrInvalidEnvironmentVariables, "CNI_CONTAINERID"},
		{"exhausted", apiErr(api.CodeExhausted, "range full"), types.ErrInternal, "no free pod address"},
		{"internal", apiErr(api.CodeInternal, "disk full"), types.ErrInternal, "disk full"},
		{"other", errors.New("boom"), types.ErrInternal, "doing it: boom"},
		{"already a CNI error", types.NewError(types.ErrInvalidNetNS, "ns", ""), types.ErrInvalidNetNS, "ns"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := routerError("doing it", tt.err)
			if got := cniCode(err); got != tt.wantCode {
				t.Errorf("code %d, want %d (%v)", got, tt.wantCode, err)
			}
			if !strings.Contains(err.Error(), tt.wantMsg) {
				t.Errorf("message %q does not contain %q", err, tt.wantMsg)
			}
		})
	}
	if routerError("x", nil) != nil {
		t.Error("routerError(nil) is not nil")
	}
}

// TestRouterErrorFromClient maps what the real client returns from a fake
// router and from a socket nobody listens on.
func TestRouterErrorFromClient(t *testing.T) {
	f := routertest.Start(t, "weft", 1376)
	c := api.NewClient(f.Socket)
	ctx := context.Background()
	req := api.AllocateRequest{Attachment: api.Attachment{ContainerID: "abc", IfName: "eth0"}}

	f.Set(func(f *routertest.Router) { f.NotReady = "waiting for peers" })
	_, err := c.Allocate(ctx, req)
	var te *types.Error
	if !errors.As(routerError("allocating", err), &te) || te.Code != types.ErrTryAgainLater ||
		te.Msg != "weft router not ready: waiting for peers; try again later" {
		t.Errorf("not ready: %v", te)
	}

	f.Set(func(f *routertest.Router) { f.NotReady, f.Exhausted = "", true })
	_, err = c.Allocate(ctx, req)
	if err = routerError("allocating", err); cniCode(err) != types.ErrInternal || !strings.Contains(err.Error(), "no free pod address") {
		t.Errorf("exhausted: %v", err)
	}

	_, err = api.NewClient(filepath.Join(routertest.ShortTempDir(t), "none.sock")).Allocate(ctx, req)
	if err = routerError("allocating", err); cniCode(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "unreachable") {
		t.Errorf("unreachable: %v", err)
	}
}
